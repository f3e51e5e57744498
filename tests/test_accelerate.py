"""transformers' Trainer and TRL's SFTTrainer under accelerate's DeepSpeed sequence parallelism, made right for the
six Mamba2 families by one call (``ds_mamba_spcp.integrations.accelerate.enable``), against the same script with
sp_size 1 in one process.

Two spawns serve every test (a module fixture): one process runs the references one after the other, and two
gloo ranks run the sequence-parallel trainings (sp_size 2, dp 1), the resume, the refusals, the negative control
(Falcon-H1 through accelerate's own path, ``enable()`` undone) and, last, DeepSpeed's data-loader adapter for a
Llama with and without ``enable()``. Besides, a few shorter runs cover what the data can look like: packed rows
from a ``datasets.Dataset`` column, rows without position_ids (one model under two Trainers in turn), TRL's
right-padded rows; a case the code refuses is recorded (``_attempt``) so that the others still run. Every
training is a plain ``Trainer`` (SGD, constant learning rate, no clipping, fp32, 5 steps of 2 rows) on tiny
random models of the six families (``tests/hf_models.py``) and token-id datasets built in the test (no
download). Each batch's rows are cropped to an even length of 18..28 tokens that changes between steps
(``sp_seq_length_is_variable``; shards of 9..14 tokens, never a multiple of the chunk size 8).

Compared with the one-process run: every step's loss and the Trainer's grad_norm, and each parameter's update
after the 5 steps (``after - before``, gathered under ZeRO-3), each as a relative error (the updates' beyond the
fp32 rounding of the parameters themselves, ``_update_error``). Bound 1e-4 (the issue's): the runs differ only by
the order of floating-point sums (the state passed between ranks, DeepSpeed's
reduction over the ranks), errors seen here are ~1e-7..1e-5 on the updates (the largest on a few SSM scalars'
updates, ill-conditioned sums, see tests/test_hf.py) and ~1e-7 on losses and norms, while a lost state or a
doubled gradient is off by 1e-2..1 (the negative control; packed rows trained as unpacked: 3e-2 on the loss,
2.6 on an update). Evaluation (``trainer.evaluate``, unsharded on
whole rows on each rank) must give the one-process eval loss within the same bound, and greedy ``generate``
the same tokens.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from tests import hf_models

# before anything loads mamba-ssm's modules: see hf_models.import_models; on a GPU, mamba-ssm's Triton modules
# first, so that transformers' unsharded path binds mamba-ssm's fused kernels (test_trainer_on_one_gpu)
hf_models.load_kernels_first() if torch.cuda.is_available() else hf_models.import_models()

from tests.dist_utils import run_ranks  # noqa: E402

pytest.importorskip("accelerate")  # TRL (packed SFT) is imported where it is used: the GPU test needs none of it

TOL = 1e-4
SP = 2
STEPS = 5
BATCH = 2
LR = 0.05
# Zamba2's tiny model at LR 0.05 amplifies fp32 rounding ~3x per step: one process against itself with its initial
# weights perturbed by 1e-7 (relative, the size of a rounding) differs in grad_norm by 1.3e-6 at step 1 and 4.5e-5 at
# step 5 (bamba: <= 2.3e-6 throughout), so no comparison of two runs that round differently holds 1e-4 there after 5
# steps. At 0.02 the same perturbation stays <= 2.0e-6 over the 5 steps.
LR_OF = {"zamba2": 0.02}
ROWS = 24  # dataset rows: 5 steps x 2 rows x (2 ranks in the sp run: each rank's loader feeds alternate steps)
MAX_LEN = 28
TIMEOUT = 900

# family -> ZeRO stage: every family at one stage, stages 1, 2 and 3 each at least once. ZeRO-3 for Mamba2, whose
# decoder layer passes hidden_states to the mixer positionally, and Falcon-H1 (the case), which names it
# (the case that ZeRO-3's leaf-module gradient hook mishandled, see integrations/transformers.py
# _hidden_states_positional; Bamba, Zamba2 and GraniteMoeHybrid at ZeRO-3: tests/test_hf.py)
CASES = {
    "mamba2": 3,
    "bamba": 2,
    "nemotron_h": 1,
    "granitemoehybrid": 2,
    "falcon_h1": 3,
    "zamba2": 2,
}
RESUME = "zamba2"  # trained again from its step-3 checkpoint
# gradient accumulation (test_gradient_accumulation): 2 micro-batches a step, 2 steps; the plain Trainer at ZeRO-2
# on prefix_collate's rows, TRL's SFTTrainer at ZeRO-3 on _sft_padded's rows (one document of 7..13 tokens each)
ACCUMULATION = dict(gradient_accumulation_steps=2, max_steps=2)
SFT_DOCS = [11, 9, 7, 5]  # document lengths of each packed row (32 tokens): the 11-9 pair crosses the border at 16

# the Gated DeltaNet families (integrations/transformers/delta.py) under the Trainer: family -> ZeRO stage, each run
# DELTA_STEPS steps of DELTA_TRAIN on tiny models built with DELTA_MODEL, and the negative control (DELTA_BUG at
# its stage, each rank's incoming delta state dropped: _drop_delta_state).
# Why these settings: on hf_models' tiny delta models as built for tests/test_hf.py, one process against itself
# with its initial weights perturbed by 1e-7 (relative) moved the grad_norm by 8.2e-2 (Qwen3-Next) and 3.6e-4
# (Qwen3.5) within 3 steps (SGD at lr 0.002, no clipping, grad norms 40..180), so no two runs that round
# differently could meet 1e-4. Measured (one gradient in fp64, 1e-7 perturbations of parameter subsets): the
# sensitivity sits in the first delta layer's inputs and in its gated RMSNorm over each head's 3 values, whose
# RMS fell to 0..2e-3 against a median 0.06..0.15 (o = S^T q ~ 0 where q is nearly orthogonal to the state's
# keys), where 1/RMS at eps 1e-6 amplifies ~1e3. That norm's eps at 0.1 (gated_eps: the delta layers' gated
# norm alone; config.rms_norm_eps sets every norm's and measured worse) took one Qwen3-Next gradient's grad_norm
# from 2.6e-4 to 5.2e-6 off under the perturbation; clipping at 1.0 bounds each step's update (lr x 1), so that
# later steps do not amplify a difference of the first. Measured through these Trainer runs: the perturbation
# moves losses <= 3.7e-7 and updates <= 8.8e-6, grad_norms by 8.8e-6 (Qwen3.5), 4.8e-5 (Qwen3-Next) and 1.8e-6
# (OLMo-hybrid) here, by 2.0e-5, 1.2e-5 and 1.6e-5 when the delta runs come first in their process (other
# batches: the floor depends on the batch). What is left sits upstream of the gated norm (embed, in_proj_qkv,
# conv1d of layer 0 perturbed alone move a gradient as much), most likely the L2 normalisation of q and k over 4
# values, whose eps transformers fixes at 1e-6 (not measured further; key/value head dims 8 measured no better).
# So TOL is 2x the worst floor seen (Qwen3-Next's grad_norm), 5x the others'; test_delta_conditioning keeps the
# floor below DELTA_FLOOR on Qwen3-Next. Kimi Linear (KDA + MLA, hf_models.KIMI): the perturbation moves its
# grad_norm by 6.6e-7, updates 1.2e-7, losses 1.0e-7 with gated_eps 0.1, and by 8.5e-5 / 2.5e-5 at eps 1e-6.
DELTA_CASES = {"qwen3_5": 2, "qwen3_next": 3, "olmo_hybrid": 1, "kimi_linear": 3}
DELTA_BUG = "qwen3_5"
DELTA_WORST = "qwen3_next"  # test_delta_conditioning's family
DELTA_STEPS = 3
DELTA_MODEL = dict(gated_eps=0.1)
DELTA_TRAIN = dict(max_steps=DELTA_STEPS, learning_rate=0.002, max_grad_norm=1.0)
DELTA_FLOOR = 5e-5  # measured 4.8e-5 at most (above)


# ---------------------------------------------------------------------------------------------------
# data, arguments, models (built identically in every process)
# ---------------------------------------------------------------------------------------------------


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, hf_models.VOCAB, (rows, MAX_LEN), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def crop_collate(rows):
    """Rows cropped to an even length of 18..28 picked from the batch's content (so it changes between steps and
    is the same for a batch in every run), with position_ids and labels."""
    ids = torch.stack([r["input_ids"] for r in rows])
    length = 18 + 2 * (int(ids[0, :4].sum()) % 6)
    ids = ids[:, :length]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).expand_as(ids).clone()}


def fixed_collate(rows):
    """Rows of 24 tokens: the negative control runs DeepSpeed's own data-loader adapter, whose all-gather of each
    rank's rows at their own length gloo refuses as soon as two ranks' lengths differ."""
    ids = torch.stack([r["input_ids"] for r in rows])[:, :24]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(24).expand_as(ids).clone()}


def prefix_collate(rows):
    """``crop_collate`` with labels -100 on a prefix of each row, 2..13 tokens long by the row's first token: the
    micro-batches of one optimizer step score different numbers of tokens (``test_gradient_accumulation``)."""
    batch = crop_collate(rows)
    for row in batch["labels"]:
        row[: 2 + int(row[0]) % 12] = -100
    return batch


def odd_collate(rows):
    batch = crop_collate(rows)
    return {k: v[:, :-1] for k, v in batch.items()}


def ds_config(stage: int, section=None, **zero) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, **zero},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if section:
        cfg["mamba_sequence_parallel"] = section
    return cfg


def training_args(out: str, stage: int, sp: int, section=None, zero=None, cls=None, **kw):
    """TrainingArguments (or ``cls``, TRL's SFTConfig) for one run; ``sp`` > 1 adds accelerate's ParallelismConfig."""
    from transformers import TrainingArguments

    pc = None
    if sp > 1:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)
    opts = dict(
        output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, max_steps=STEPS,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
        deepspeed=ds_config(stage, section, **(zero or {})), parallelism_config=pc,
    )  # fmt: skip
    opts.update(kw)
    return (cls or TrainingArguments)(**opts)


def _params(trainer) -> dict:
    """Full parameters (gathered under ZeRO-3), detached copies."""
    import deepspeed

    model = trainer.model
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(
    family: str, stage: int, sp: int, out: str, collate=crop_collate, sizes=None, *, model=None, dataset=None,
    evaluate=True, **kw,
) -> dict:  # fmt: skip
    """One Trainer run: per-step (loss, grad_norm), the update of every parameter, eval loss, greedy tokens (not
    after a resume, nor with ``evaluate=False``). ``model`` (default: a fresh one of ``family``) and ``dataset``
    (default: ``TokenRows``) are given for the runs of one model twice, of datasets.Dataset columns."""
    from transformers import Trainer

    model = model if model is not None else hf_models.build(family, sizes=sizes)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    resume = kw.pop("resume_from_checkpoint", None)
    kw.setdefault("learning_rate", LR_OF.get(family, LR))
    args = training_args(out, stage, sp, **kw)
    dataset = dataset if dataset is not None else TokenRows(ROWS)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    after = _params(trainer)
    result = {"logs": logs, "update": _updates(before, after)}
    if resume is None and evaluate:
        result["eval_loss"] = trainer.evaluate(TokenRows(4, seed=1))["eval_loss"]
        unwrapped = trainer.model.eval()
        prompt = TokenRows(1, seed=2).ids[:, :6].to(unwrapped.device)
        with torch.no_grad():
            result["generated"] = unwrapped.generate(
                input_ids=prompt,
                position_ids=torch.arange(6, device=prompt.device)[None],
                max_new_tokens=4,
                do_sample=False,
            ).tolist()
    return result


def _updates(before: dict, after: dict) -> dict:
    """Each parameter's update ``after - before`` (exact: the two fp32 values are close) and the fp32 spacing (ulp)
    of its parameters, from which ``_errors`` takes the rounding floor of that update."""
    # numpy arrays: pickled by value (torch tensors would cross to the test process through shared memory that
    # the rank process releases when it exits)
    import numpy as np

    return {n: ((after[n].cpu() - before[n].cpu()).numpy(), np.spacing(np.abs(after[n].cpu().numpy())))
            for n in before}  # fmt: skip


def _error(fn) -> str:
    """The message of what ``fn`` raises (each rank records its own)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _attempt(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": its message}``: a case that every rank refuses alike lets the spawn go on to the
    next one, and its test reports the message."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test reports it
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------------
# TRL: packed SFT
# ---------------------------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(hf_models.VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def _sft_dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, hf_models.VOCAB, (n,), generator=g).tolist() for _ in range(ROWS) for n in SFT_DOCS]
    return Dataset.from_dict({"input_ids": docs})


def _per_document(model):
    """The oracle of a packed row in one process: the backbone run on each document separately (transformers'
    PyTorch path keeps packed documents apart only with mamba-ssm's CUDA kernels)."""
    backbone = model.base_model
    forward = backbone.forward

    def split_forward(*args, input_ids=None, position_ids=None, **kwargs):
        for key in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(key, None)
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [position_ids.shape[1]]
        outs = [
            forward(input_ids=input_ids[:, a:b], position_ids=position_ids[:, a:b], **kwargs)
            for a, b in zip(starts[:-1], starts[1:])
        ]
        out = outs[0]
        out.last_hidden_state = torch.cat([o.last_hidden_state for o in outs], dim=1)
        return out

    backbone.forward = split_forward


def _sft(family: str, sp: int, out: str, *, attention=False, oracle=False) -> dict:
    from trl import SFTConfig, SFTTrainer

    model = hf_models.build(family, attention=attention)
    if oracle:
        _per_document(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(
        out, 2, sp, cls=SFTConfig, per_device_train_batch_size=1, packing=True, max_length=sum(SFT_DOCS),
        pad_to_multiple_of=SP,
    )  # fmt: skip
    crossings = []
    if sp > 1:  # record, per step, whether a document crosses the shard border (position 0 not at rank 1's start)

        def record(module, a, kw):
            if module.training:
                crossings.append(int(kw["position_ids"][0, 0]) != 0)

        model.register_forward_pre_hook(record, with_kwargs=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_sft_dataset(), processing_class=_tokenizer())
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    after = _params(trainer)
    return {"logs": logs, "update": _updates(before, after), "crossings": crossings}


# ---------------------------------------------------------------------------------------------------
# datasets.Dataset columns, one model prepared twice, right padding, a model without the mixers
# ---------------------------------------------------------------------------------------------------

PACKED_DOCS = [[10, 8, 6], [13, 11], [12, 12], [5, 9, 10]]  # rows of 24: documents across the border at 12, on it
PADDED_DOCS = [11, 9, 13, 7]  # one document per row, odd lengths: pad_to_multiple_of=2 pads each with one token


def _packed_rows():
    """datasets.Dataset of packed rows of 24 tokens with a position_ids column restarting at every document (labels
    -100 at each document's first token, as TRL's padding-free collator sets them)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(4)
    columns: dict = {"input_ids": [], "labels": [], "position_ids": []}
    for i in range(ROWS):
        docs = PACKED_DOCS[i % len(PACKED_DOCS)]
        ids = torch.randint(0, hf_models.VOCAB, (sum(docs),), generator=g)
        positions = torch.cat([torch.arange(n) for n in docs])
        columns["input_ids"].append(ids.tolist())
        columns["labels"].append(ids.masked_fill(positions == 0, -100).tolist())
        columns["position_ids"].append(positions.tolist())
    return Dataset.from_dict(columns)


def _unpacked_rows():
    """datasets.Dataset of rows of 20 tokens, input_ids and labels only: no position_ids anywhere."""
    from datasets import Dataset

    ids = torch.randint(0, hf_models.VOCAB, (ROWS, 20), generator=torch.Generator().manual_seed(5))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _per_document_lm(model):
    """The oracle of packed rows in one process for Mamba2ForCausalLM, which passes no position_ids to its backbone
    (so ``_per_document`` cannot split there): each document of each row run alone, the logits put back in place and
    scored by the model's own loss over the whole rows. Its forward names position_ids: the Trainer keeps them."""
    from transformers.modeling_outputs import CausalLMOutput

    forward = model.forward

    def split_forward(input_ids=None, labels=None, position_ids=None, **kwargs):
        rows = []
        for ids, positions in zip(input_ids, position_ids):
            starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
            docs = [forward(input_ids=ids[None, a:b]).logits for a, b in zip(starts[:-1], starts[1:])]
            rows.append(torch.cat(docs, dim=1))
        logits = torch.cat(rows)
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)

    model.forward = split_forward


def _train_packed_columns(sp: int, out: str) -> dict:
    """Mamba2 under the plain Trainer on ``_packed_rows`` (default_data_collator); under sequence parallelism,
    per training call whether seq_idx reached the model (after enable()'s hook derived it from position_ids)."""
    from transformers import default_data_collator

    model = hf_models.build("mamba2")
    calls = []
    if sp == 1:
        _per_document_lm(model)
    else:
        model.register_forward_pre_hook(
            lambda module, a, kw: calls.append(kw.get("seq_idx") is not None) if module.training else None,
            with_kwargs=True,
        )  # fmt: skip
    result = _train(
        "mamba2", 2, sp, out, default_data_collator, model=model, dataset=_packed_rows(), evaluate=False, max_steps=3
    )  # fmt: skip
    return {**result, "seq_idx": calls}


def _train_twice(sp: int, out: str) -> dict:
    """One Mamba2 model trained by two Trainers in turn (2 steps each, ZeRO-2) on ``_unpacked_rows``; the names of
    the model's forward hooks afterwards."""
    from transformers import default_data_collator

    model = hf_models.build("mamba2")
    data = _unpacked_rows()
    runs = []
    for i in range(2):
        path = f"{out}_{i}"
        runs.append(_train("mamba2", 2, sp, path, default_data_collator, model=model, dataset=data, evaluate=False,
                           max_steps=2))  # fmt: skip
    hooks = [getattr(h, "__name__", "") for h in (*model._forward_pre_hooks.values(), *model._forward_hooks.values())]
    return {"runs": runs, "hooks": hooks}


def _sft_padded(sp: int, out: str, stage: int = 2, **kw) -> dict:
    """TRL's SFTTrainer with packing=False, one document of odd length per row (Bamba, sdpa attention). Under
    sequence parallelism pad_to_multiple_of=2 pads each row with one token (position 0, label -100, attention_mask
    0); the one-process reference runs the rows unpadded. Besides the Trainer's logs, what TRL logs: its token
    count ``num_tokens`` (the attention_mask's sum), ``entropy`` and ``mean_token_accuracy``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(6)
    lengths = PADDED_DOCS * (ROWS // len(PADDED_DOCS))
    docs = [torch.randint(3, hf_models.VOCAB, (n,), generator=g).tolist() for n in lengths]
    model = hf_models.build("bamba")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(
        out, stage, sp, cls=SFTConfig, per_device_train_batch_size=1, packing=False, max_length=32,
        pad_to_multiple_of=SP if sp > 1 else None, **{"max_steps": 3, **kw},
    )  # fmt: skip
    data = Dataset.from_dict({"input_ids": docs})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    trl_logs = {key: [h[key] for h in history] for key in ("num_tokens", "entropy", "mean_token_accuracy")}
    return {"logs": [(h["loss"], h["grad_norm"]) for h in history], "update": _updates(before, _params(trainer)),
            **trl_logs}  # fmt: skip


def _delta_train(family: str, sp: int, out: str, perturb: float = 0.0) -> dict:
    """One Trainer run of a Gated DeltaNet family (``DELTA_CASES``' stage, ``DELTA_MODEL``, ``DELTA_TRAIN``), its
    initial weights multiplied by ``1 + perturb * N(0, 1)`` (a seeded draw) for the conditioning check."""
    model = hf_models.build(family, **DELTA_MODEL)
    if perturb:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=g))
    return _train(family, DELTA_CASES[family], sp, out, model=model, **DELTA_TRAIN)


def _delta_lora(sp: int, out: str, conv: bool = False) -> dict:
    """PEFT's LoRA (r 2, PEFT's init: B = 0) on Qwen3.5's delta projections and attention, DELTA_BUG's stage;
    ``conv``: on the delta layers' conv1d too (r = its channels: PEFT takes a depthwise conv only so), refused."""
    import peft

    model = hf_models.build("qwen3_5", **DELTA_MODEL)
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj", "v_proj"]
    r = model.model.layers[0].linear_attn.conv1d.in_channels if conv else 2
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=targets + ["conv1d"] * conv))
    return _train("qwen3_5", DELTA_CASES["qwen3_5"], sp, out, model=model, evaluate=False, **DELTA_TRAIN)


def _delta_packed(sp: int, out: str) -> dict:
    """Qwen3.5 without attention (two delta layers: packed rows with attention need a flash attention, a GPU) on
    ``_packed_rows`` (position_ids restarting at every document); one process runs each document alone
    (``_per_document_lm``: transformers' CPU conv ignores the documents)."""
    from transformers import default_data_collator

    model = hf_models.build("qwen3_5", attention=False, use_cache=False, **DELTA_MODEL)
    if sp == 1:
        _per_document_lm(model)
    return _train("qwen3_5", DELTA_CASES["qwen3_5"], sp, out, default_data_collator, model=model,
                  dataset=_packed_rows(), evaluate=False, **DELTA_TRAIN)  # fmt: skip


# Qwen3.5-MoE's router load-balancing loss (router_loss.py): 2 experts, 1 a token (with 2 of 2, as hf_models
# builds it, every expert is chosen and aux is constant), a coefficient of 0.5 so that its share of the routers'
# gradient shows. The 1e-7 perturbation of the initial weights (above) moves this run's grad_norm by 1.3e-5,
# updates 5.0e-6, losses 2.7e-7; with 4 experts, top-2 it moved the grad_norm by 1.2e-4 (top-4 of 4, where no
# routing can flip, by 1.3e-4: the 4-expert tiny model is ill-conditioned, not its routing).
DELTA_ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_experts=2, num_experts_per_tok=1)


# Qwen3-Next's router differs from Qwen3.5-MoE's by norm_topk_prob (transformers 5.24; the load-balancing loss is
# the same function): off here, so that the top-1 weight is the router's probability and the routers' gradient
# comes through the experts' weights as well as through aux (on, a top-1 weight is 1: no gradient there)
DELTA_ROUTER_NEXT = dict(DELTA_ROUTER, norm_topk_prob=False)


def _delta_router(sp: int, out: str, family: str = "qwen3_5_moe") -> dict:
    """A delta MoE family (Qwen3.5-MoE at DELTA_BUG's stage; Qwen3-Next with ``DELTA_ROUTER_NEXT`` at its
    DELTA_CASES stage) with its router loss through the Trainer: transformers' own aux loss in one process,
    router_loss.py's (sums over the group) at sp > 1."""
    if family == "qwen3_next":
        model, stage = hf_models.build(family, **DELTA_MODEL, **DELTA_ROUTER_NEXT), DELTA_CASES[family]
    else:
        model, stage = hf_models.build(family, **DELTA_MODEL, **DELTA_ROUTER), DELTA_CASES["qwen3_5"]
    return _train(family, stage, sp, out, model=model, evaluate=False, **DELTA_TRAIN)


def _drop_delta_state():
    """The negative control's bug: every rank's delta layers start their shard from a zero state (the exchanged
    state replaced by zeros after the exchange ran, so that the ranks still meet in its collectives). Returns the
    undo."""
    from ds_mamba_spcp.engine.strategies import delta as strategy

    exchange_fn = strategy._ExchangeFn

    class Dropped:
        @staticmethod
        def apply(*args):
            S_in, final = exchange_fn.apply(*args)
            return torch.zeros_like(S_in), final

    strategy._ExchangeFn = Dropped
    return lambda: setattr(strategy, "_ExchangeFn", exchange_fn)


def _accumulation(sp: int, tmp: str) -> dict:
    """The two gradient-accumulation runs (``ACCUMULATION``), each recorded or its error, and their seconds."""
    t0 = time.perf_counter()
    trainer = _attempt(
        lambda: _train("bamba", 2, sp, os.path.join(tmp, f"accumulation{sp}"), prefix_collate, evaluate=False,
                       **ACCUMULATION)
    )  # fmt: skip
    sft = _attempt(lambda: _sft_padded(sp, os.path.join(tmp, f"sft_accumulation{sp}"), 3, **ACCUMULATION))
    return {"trainer": trainer, "sft": sft, "seconds": time.perf_counter() - t0}


def _llama():
    """A tiny LlamaForCausalLM (sdpa): a model without any of the six mixers."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=hf_models.VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=20,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def varlen_collate(rows):
    """Rows of 16 tokens packed as 10 + 6, with the whole-row keys DeepSpeed's adapter passes on (a 2-D seq_idx, an
    int max_length_q) and an all-ones attention_mask."""
    ids = torch.stack([r["input_ids"] for r in rows])[:, :16]
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand_as(ids).clone()
    seq_idx = (positions == 0).cumsum(dim=1).to(torch.int32) - 1
    return {
        "input_ids": ids, "labels": ids.clone(), "position_ids": positions, "seq_idx": seq_idx, "max_length_q": 10,
        "attention_mask": torch.ones_like(ids),
    }  # fmt: skip


def _adapter_batches(out: str, core_sdpa) -> list[dict]:
    """The micro-batches DeepSpeed's data-loader adapter hands the Trainer for a Llama (2 steps), as (array, device,
    dtype) per tensor. accelerate's own path creates the sequence-parallel group (asserting that none exists) and
    registers DeepSpeed's attention for the whole process: both are undone first."""
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers import Trainer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    dist.barrier()
    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = core_sdpa
    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            tensors = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
            seen.append({**inputs, **{k: (v.numpy().copy(), str(v.device), str(v.dtype)) for k, v in tensors.items()}})
            # what a Llama's forward takes (the rest is what is compared)
            keep = {k: v for k, v in inputs.items() if k in ("input_ids", "labels", "shift_labels", "position_ids")}
            return super().training_step(model, keep, *args, **kwargs)

    args = training_args(out, 1, SP, max_steps=2)
    Recording(model=_llama(), args=args, train_dataset=TokenRows(8), data_collator=varlen_collate).train()
    return seen


# ---------------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------------


def _references(rank, world, tmp):
    """The same script with sp_size 1 in one process."""
    t0 = time.perf_counter()
    out = {fam: _train(fam, stage, 1, os.path.join(tmp, f"ref_{fam}")) for fam, stage in CASES.items()}
    out["sft"] = _sft("mamba2", 1, os.path.join(tmp, "ref_sft"), oracle=True)
    out["falcon_h1_fixed"] = _train("falcon_h1", CASES["falcon_h1"], 1, os.path.join(tmp, "ref_fixed"), fixed_collate)
    out["packed_columns"] = _train_packed_columns(1, os.path.join(tmp, "ref_columns"))
    out["twice"] = _train_twice(1, os.path.join(tmp, "ref_twice"))
    out["padded"] = _sft_padded(1, os.path.join(tmp, "ref_padded"))
    out["accumulation"] = _accumulation(1, tmp)
    t1 = time.perf_counter()
    for fam in DELTA_CASES:
        out[f"delta_{fam}"] = _delta_train(fam, 1, os.path.join(tmp, f"ref_delta_{fam}"))
    perturbed = os.path.join(tmp, "ref_delta_perturbed")
    out["delta_perturbed"] = _delta_train(DELTA_WORST, 1, perturbed, perturb=1e-7)
    out["delta_lora"] = _delta_lora(1, os.path.join(tmp, "ref_delta_lora"))
    out["delta_packed"] = _delta_packed(1, os.path.join(tmp, "ref_delta_packed"))
    out["delta_router"] = _delta_router(1, os.path.join(tmp, "ref_delta_router"))
    out["delta_router_next"] = _delta_router(1, os.path.join(tmp, "ref_delta_router_next"), "qwen3_next")
    out["delta_seconds"] = time.perf_counter() - t1
    out["seconds"] = time.perf_counter() - t0
    return out


def _sequence_parallel(rank, world, tmp):
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    t0 = time.perf_counter()
    core_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mamba_sp.enable()
    from tests.parse_count import parses

    # RESUME's run saves at step 3 (saving draws nothing: the run is the one compared with one process), then a
    # fresh Trainer resumes from that checkpoint and runs steps 4 and 5
    save = dict(save_strategy="steps", save_steps=3)
    with parses() as parsed:
        out = {fam: _train(fam, stage, SP, os.path.join(tmp, f"sp_{fam}"), **(save if fam == RESUME else {}))
               for fam, stage in CASES.items()}  # fmt: skip
    out["parsed"] = dict(parsed)
    ckpt = os.path.join(tmp, f"sp_{RESUME}")
    out["resume_full"] = out[RESUME]
    out["resume"] = _train(
        RESUME, CASES[RESUME], SP, ckpt, resume_from_checkpoint=os.path.join(ckpt, "checkpoint-3")
    )  # fmt: skip
    out["sft"] = _sft("mamba2", SP, os.path.join(tmp, "sp_sft"))
    out["packed_columns"] = _attempt(_train_packed_columns, SP, os.path.join(tmp, "sp_columns"))
    out["twice"] = _attempt(_train_twice, SP, os.path.join(tmp, "sp_twice"))
    out["padded"] = _attempt(_sft_padded, SP, os.path.join(tmp, "sp_padded"))
    out["accumulation"] = _accumulation(SP, tmp)
    t1 = time.perf_counter()
    for fam in DELTA_CASES:
        out[f"delta_{fam}"] = _attempt(_delta_train, fam, SP, os.path.join(tmp, f"sp_delta_{fam}"))
    out["delta_lora"] = _attempt(_delta_lora, SP, os.path.join(tmp, "sp_delta_lora"))
    out["delta_packed"] = _attempt(_delta_packed, SP, os.path.join(tmp, "sp_delta_packed"))
    out["delta_router"] = _attempt(_delta_router, SP, os.path.join(tmp, "sp_delta_router"))
    out["delta_router_next"] = _attempt(_delta_router, SP, os.path.join(tmp, "sp_delta_router_next"), "qwen3_next")
    from ds_mamba_spcp import comm

    summed, comm.all_reduce_sum = comm.all_reduce_sum, lambda t, group: t  # the control: each shard's router loss
    try:
        out["delta_router_bug"] = _attempt(_delta_router, SP, os.path.join(tmp, "sp_delta_router_bug"))
        out["delta_router_next_bug"] = _attempt(
            _delta_router, SP, os.path.join(tmp, "sp_delta_router_next_bug"), "qwen3_next"
        )  # fmt: skip
    finally:
        comm.all_reduce_sum = summed
    undo = _drop_delta_state()
    try:
        out["delta_bug"] = _attempt(_delta_train, DELTA_BUG, SP, os.path.join(tmp, "sp_delta_bug"))
    finally:
        undo()
    out["delta_seconds"] = time.perf_counter() - t1

    errors = {}
    errors["zigzag"] = _error(
        lambda: _train("bamba", 2, SP, os.path.join(tmp, "e1"), section={"input_layout": "zigzag",
                                                                        "load_balancing": "virtual"})
    )  # fmt: skip
    errors["reduce_scatter"] = _error(
        lambda: _train("mamba2", 3, SP, os.path.join(tmp, "e2"), zero={"reduce_scatter": False})
    )
    errors["size"] = _error(
        lambda: _train("mamba2", 2, SP, os.path.join(tmp, "e3"), section={"sequence_parallel_size": 4})
    )
    errors["odd_length"] = _error(lambda: _train("nemotron_h", 2, SP, os.path.join(tmp, "e4"), collate=odd_collate))
    errors["packed_sdpa"] = _error(lambda: _sft("bamba", SP, os.path.join(tmp, "e5"), attention=True))
    errors["disabled_section"] = _error(
        lambda: _train("bamba", 2, SP, os.path.join(tmp, "e6"), section={"enabled": False})
    )
    errors["delta_lora_conv1d"] = _error(lambda: _delta_lora(SP, os.path.join(tmp, "e8"), conv=True))
    mamba_sp.disable()
    errors["without_enable"] = _error(lambda: _train("nemotron_h", 2, SP, os.path.join(tmp, "e7")))
    out["errors"] = errors

    # negative control, last: accelerate's own path registers DeepSpeed's attention for the whole process and
    # creates the sequence-parallel group itself (asserting that none exists)
    dist.barrier()
    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = core_sdpa
    out["bug_falcon_h1"] = _train("falcon_h1", CASES["falcon_h1"], SP, os.path.join(tmp, "bug"), fixed_collate)

    # a model without the mixers: DeepSpeed's data-loader adapter, with and without enable()
    out["adapter_plain"] = _adapter_batches(os.path.join(tmp, "llama_plain"), core_sdpa)
    mamba_sp.enable()
    out["adapter_enabled"] = _adapter_batches(os.path.join(tmp, "llama_enabled"), core_sdpa)
    mamba_sp.disable()
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t0 = time.perf_counter()
    ref = run_ranks(_references, 1, str(tmp_path_factory.mktemp("ref")), timeout=TIMEOUT)[0]
    sp = run_ranks(_sequence_parallel, SP, str(tmp_path_factory.mktemp("sp")), timeout=TIMEOUT)
    print(f"\nreferences {ref['seconds']:.0f} s, sequence-parallel ranks {sp[0]['seconds']:.0f} s, "
          f"total {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return ref, sp


def _update_error(got, want) -> float:
    """Relative error (RMS) of an update against the one-process update, beyond the fp32 rounding of the parameters.

    Each run stores its parameter in fp32 after every step (p <- fl(p - lr g)), a rounding of up to half an ulp of
    p per step and run: two runs whose gradients agree to ~1e-7 can still end a few ulps of p apart. Where p is
    O(1) and its update is ~1e-3 (an SSM's dt_bias after 5 steps: ulp 1.2e-7..4.8e-7), that alone is ~1e-4 of the
    update, whatever the code does (seen: Zamba2's dt_bias 1 to 4.5 ulps apart, 2.2e-4 relative on one CPU model,
    6.7e-5 on another). So each element's difference beyond STEPS ulps of its parameter (both runs' roundings) is
    what counts; a wrong gradient still shows in full (the negative controls are off by 1e-2..1)."""
    (u, _), (w, spacing) = got, want
    excess = (abs(u.astype("float64") - w) - STEPS * spacing).clip(min=0)
    return float((excess**2).sum() ** 0.5 / max((w.astype("float64") ** 2).sum() ** 0.5, 1e-30))


def _errors(run: dict, ref: dict) -> dict:
    """Largest relative error of the per-step losses, of the grad_norms and of any parameter's update."""
    assert len(run["logs"]) == len(ref["logs"]), (run["logs"], ref["logs"])
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(run["logs"], ref["logs"]))
    norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(run["logs"], ref["logs"]))
    updates = {n: _update_error(u, ref["update"][n]) for n, u in run["update"].items()}
    worst = max(updates, key=updates.get)
    return {"loss": loss, "grad_norm": norm, "update": updates[worst], "worst": worst}


@pytest.mark.parametrize("family", list(CASES))
def test_trainer_matches_one_process(runs, family):
    ref, sp = runs
    for rank, run in enumerate(sp):
        err = _errors(run[family], ref[family])
        print(f"{family} ZeRO-{CASES[family]} rank {rank}: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err
        # evaluation and generate: unsharded, whole rows on every rank
        assert abs(run[family]["eval_loss"] - ref[family]["eval_loss"]) <= TOL * abs(ref[family]["eval_loss"])
        assert run[family]["generated"] == ref[family]["generated"]


def test_settings_parsed_once_per_trainer(runs):
    """Each Trainer (enable(), build, train) reads accelerate's ds_config once and parses it once into the typed
    settings (issue 43 item 4); 018f6c7: 3 reads of the plugin's ds_config per Trainer (18 over the 6 runs)."""
    once = {"load_mamba_sp_config": 1, "ds_config_dict": 1, "accelerate_ds_config": 1}
    _, sp = runs
    for rank, run in enumerate(sp):
        assert run["parsed"] == {k: v * len(CASES) for k, v in once.items()}, f"rank {rank}: {run['parsed']}"


def test_negative_control_accelerate_alone(runs):
    """Falcon-H1 through accelerate's own path (no enable()): each rank's Mamba layers restart from zero."""
    ref, sp = runs
    err = _errors(sp[0]["bug_falcon_h1"], ref["falcon_h1_fixed"])
    print(f"negative control (Falcon-H1, accelerate alone): {err}")
    assert err["update"] > 100 * TOL, err


def test_delta_conditioning(runs):
    """The justification of the bound for the Gated DeltaNet cases: one process against itself with its initial
    weights perturbed by 1e-7 (the size of a rounding) moves the losses, grad_norms and updates by < DELTA_FLOOR
    (run on DELTA_WORST, the family with the largest floor measured; the others' are in the comment above)."""
    ref, _ = runs
    err = _errors(ref["delta_perturbed"], ref[f"delta_{DELTA_WORST}"])
    print(f"{DELTA_WORST}: 1e-7 perturbation of the initial weights: {err}")
    assert err["loss"] <= DELTA_FLOOR and err["grad_norm"] <= DELTA_FLOOR and err["update"] <= DELTA_FLOOR, err


@pytest.mark.parametrize("family", list(DELTA_CASES))
def test_delta_trainer_matches_one_process(runs, family):
    """A Gated DeltaNet family under the Trainer at sp 2 (``DELTA_CASES``' ZeRO stage) against one process: every
    step's loss and grad_norm, every update, the eval loss and greedy tokens, within TOL (2x the perturbation
    floor, test_delta_conditioning); the negative control (Qwen3.5, each rank's incoming state dropped) is off
    by > 100x TOL."""
    ref, sp = runs
    print(f"delta runs: {ref['delta_seconds']:.1f} s in one process (with the perturbed runs), "
          f"{sp[0]['delta_seconds']:.1f} s on the ranks (with the negative control)")  # fmt: skip
    for rank, run in enumerate(sp):
        mine, theirs = run[f"delta_{family}"], ref[f"delta_{family}"]
        assert "error" not in mine, mine["error"]
        err = _errors(mine, theirs)
        print(f"{family} ZeRO-{DELTA_CASES[family]} rank {rank}: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err
        assert abs(mine["eval_loss"] - theirs["eval_loss"]) <= TOL * abs(theirs["eval_loss"])
        assert mine["generated"] == theirs["generated"]
        if family == DELTA_BUG:
            assert "error" not in run["delta_bug"], run["delta_bug"]["error"]
            bug = _errors(run["delta_bug"], theirs)
            print(f"negative control ({family}, incoming state dropped) rank {rank}: {bug}")
            assert bug["update"] > 100 * TOL, bug


def test_delta_lora_matches_one_process(runs):
    """PEFT's LoRA on Qwen3.5 (its delta projections, out_proj and attention) through the Trainer at sp 2 against the
    PeftModel in one process (the delta layers' projections are called as modules: PEFT's layers run in the sharded
    path; LoRA on conv1d is refused, test_refusals_on_every_rank)."""
    ref, sp = runs
    for run in sp:
        assert "error" not in run["delta_lora"], run["delta_lora"]["error"]
        err = _errors(run["delta_lora"], ref["delta_lora"])
        print(f"LoRA on qwen3_5: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err


def test_delta_packed_matches_one_process(runs):
    """Packed rows (a datasets.Dataset's position_ids column restarting at every document, documents across the
    shard border) on Qwen3.5 without attention through the Trainer at sp 2, against one process running each
    document alone."""
    ref, sp = runs
    for run in sp:
        assert "error" not in run["delta_packed"], run["delta_packed"]["error"]
        err = _errors(run["delta_packed"], ref["delta_packed"])
        print(f"packed rows on qwen3_5: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_delta_router_loss_matches_one_process(runs, family):
    """Qwen3.5-MoE (ZeRO-2) and Qwen3-Next (ZeRO-3, norm_topk_prob off: DELTA_ROUTER_NEXT) with output_router_logits
    and router_aux_loss_coef through the Trainer at sp 2 against one process (transformers' own load-balancing loss
    there): the router loss's sums are the group's (router_loss.py; the control takes each shard's alone). Before
    (018f6c7) Qwen3.5-MoE's sharded run was refused, and at 2f6f4b8 Qwen3-Next's
    ("config.output_router_logits=False ... for sequence-parallel training")."""
    ref, sp = runs
    key = "delta_router" if family == "qwen3_5_moe" else "delta_router_next"
    for run in sp:
        assert "error" not in run[key], run[key]["error"]
        err = _errors(run[key], ref[key])
        print(f"router loss on {family}: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err
        # negative control: each rank's router loss from its shard's rows alone (the group's sums not taken)
        assert "error" not in run[f"{key}_bug"], run[f"{key}_bug"]["error"]
        bug = _errors(run[f"{key}_bug"], ref[key])
        print(f"router loss on {family}, each shard's alone: {bug}")
        # measured: Qwen3.5-MoE's routers' updates 1.8 off, the loss 6.7e-4; Qwen3-Next's updates 7.7e-3 off (its
        # routers' gradient also comes through the experts' weights, unchanged by the bug), the loss 2.1e-4
        assert bug["update"] > (100 if family == "qwen3_5_moe" else 30) * TOL, bug


def test_resume_from_checkpoint(runs):
    """Steps 4 and 5 after resuming from the step-3 checkpoint are those of the uninterrupted run."""
    ref, sp = runs
    for run in sp:
        full, resumed = run["resume_full"], run["resume"]
        # the resumed Trainer's log history: the checkpoint's 3 steps, then its own steps 4 and 5
        assert len(resumed["logs"]) == STEPS and resumed["logs"][:3] == full["logs"][:3], resumed["logs"]
        for (a, na), (b, nb) in zip(resumed["logs"][3:], full["logs"][3:]):
            assert abs(a - b) <= TOL * abs(b) and abs(na - nb) <= TOL * abs(nb), (resumed["logs"], full["logs"])
        assert _errors(full, ref[RESUME])["update"] <= TOL
        assert _errors(resumed, ref[RESUME])["update"] <= TOL  # the same parameters at the end


def test_sft_packed_matches_one_process(runs):
    """TRL's SFTTrainer, packing=True (padding-free rows, positions restarting per document), Mamba2: against
    one process that runs each document separately; at some steps a document crosses the shard border."""
    ref, sp = runs
    crossings = sp[1]["sft"]["crossings"]  # rank 1's shard starts inside a document
    assert len(crossings) == STEPS and any(crossings), crossings
    for run in sp:
        err = _errors(run["sft"], ref["sft"])
        print(f"SFT packed: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err


def test_dataset_position_ids_reach_the_mixers(runs):
    """Mamba2ForCausalLM.forward names no position_ids, so the Trainer's remove_unused_columns dropped a
    datasets.Dataset's position_ids column and the adapter refused the batch ("add it in the data collator"). With
    enable() the column is kept: every training call of packed rows gets seq_idx, and the run equals one process
    running each document alone."""
    ref, sp = runs
    for run in sp:
        assert "error" not in run["packed_columns"], run["packed_columns"]["error"]
        calls = run["packed_columns"]["seq_idx"]
        assert len(calls) == 3 and all(calls), calls
        err = _errors(run["packed_columns"], ref["packed_columns"])
        print(f"packed rows from a dataset column: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err


def test_one_model_prepared_twice(runs):
    """Two Trainers in turn on one Mamba2 model, on rows without position_ids (unpacked rows: the adapter numbers
    whole rows; DeepSpeed's refused them). The second preparation keeps the first's mixers and hooks (installed
    once), and both runs equal one process's."""
    ref, sp = runs
    for run in sp:
        assert "error" not in run["twice"], run["twice"]["error"]
        hooks = run["twice"]["hooks"]
        assert [hooks.count(h) for h in ("_before_call", "_check_model_call", "_after_call")] == [1, 1, 1], hooks
        for i, (mine, theirs) in enumerate(zip(run["twice"]["runs"], ref["twice"]["runs"])):
            err = _errors(mine, theirs)
            print(f"prepared twice, Trainer {i + 1}: {err}")
            assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err


def test_right_padding_is_not_a_document(runs):
    """TRL, packing=False, pad_to_multiple_of=2, sdpa attention (Bamba): the padded tail (position 0, label -100,
    attention_mask 0) was read as a packed second document and refused. The losses, grad_norms and every parameter's
    update equal those of the unpadded rows in one process (the bound of the module: the tail changes where the
    shards are cut, so sums are reordered)."""
    ref, sp = runs
    for run in sp:
        assert "error" not in run["padded"], run["padded"]["error"]
        err = _errors(run["padded"], ref["padded"])
        print(f"right-padded rows: {err}")
        assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err
        _assert_trl_logs(run["padded"], ref["padded"])


def _assert_trl_logs(run: dict, ref: dict) -> None:
    """What TRL logs besides the loss: ``num_tokens`` (a count: exact; on b97e3d3 the adapter dropped the
    attention_mask, so TRL counted each shard's position_ids.size(1), padding included: 12, 22, 30 against 11, 20,
    27), ``entropy`` and ``mean_token_accuracy`` (ratios of sums over the whole rows: the module's bound)."""
    assert run["num_tokens"] == ref["num_tokens"], (run["num_tokens"], ref["num_tokens"])
    for key in ("entropy", "mean_token_accuracy"):
        for a, b in zip(run[key], ref[key], strict=True):
            assert abs(a - b) <= TOL * max(abs(b), 1e-3), (key, run[key], ref[key])


def test_gradient_accumulation(runs):
    """Gradient accumulation 2 (``ACCUMULATION``) on micro-batches that score different numbers of tokens: the plain
    Trainer at ZeRO-2 (labels -100 on a prefix of each row, ``prefix_collate``) and TRL's SFTTrainer at ZeRO-3
    (right-padded rows of different lengths). One process divides each micro-batch's token sum by the scored tokens
    of the whole step (transformers' ``num_items_in_batch``); under sequence parallelism the Trainer counts none and
    averaged the micro-batches alike. On b97e3d3: the Trainer's loss 1.2e-2 off, grad_norm 0.12, updates 0.34; TRL's
    loss 2.4e-2, grad_norm 7.2e-2, updates 0.25, its num_tokens 22, 42 against 20, 38."""
    ref, sp = runs
    print(f"gradient accumulation runs: {ref['accumulation']['seconds']:.0f} s in one process, "
          f"{sp[0]['accumulation']['seconds']:.0f} s on the ranks")  # fmt: skip
    for run in sp:
        for case in ("trainer", "sft"):
            mine, theirs = run["accumulation"][case], ref["accumulation"][case]
            assert "error" not in mine, mine["error"]
            err = _errors(mine, theirs)
            print(f"gradient accumulation 2, {case}: {err}")
            assert err["loss"] <= TOL and err["grad_norm"] <= TOL and err["update"] <= TOL, err
        _assert_trl_logs(run["accumulation"]["sft"], ref["accumulation"]["sft"])


def test_adapter_unchanged_without_the_mixers(runs):
    """A Llama (no Mamba2 mixer) gets DeepSpeed's own data-loader adapter under enable(): every micro-batch the
    Trainer receives has the same keys, values, shapes, dtypes and devices as without enable() (before, the whole-row
    keys seq_idx and max_length_q were dropped)."""
    import numpy as np

    _, sp = runs
    for run in sp:
        plain, enabled = run["adapter_plain"], run["adapter_enabled"]
        assert len(plain) == len(enabled) == 2
        for a, b in zip(plain, enabled):
            assert sorted(a) == sorted(b), (sorted(a), sorted(b))
            assert {"seq_idx", "max_length_q", "shift_labels"} <= set(a)
            for key in a:
                if isinstance(a[key], tuple):
                    assert np.array_equal(a[key][0], b[key][0]) and a[key][1:] == b[key][1:], key
                else:
                    assert a[key] == b[key], key


EXPECTED_ERRORS = {
    "zigzag": ("ValueError", "mamba_sequence_parallel.input_layout"),
    "reduce_scatter": ("ValueError", "zero_optimization.reduce_scatter"),
    "size": ("ValueError", "mamba_sequence_parallel.sequence_parallel_size"),
    "odd_length": ("ValueError", "pad_to_multiple_of=2"),
    "packed_sdpa": ("NotImplementedError", "packed rows (seq_idx)"),
    "delta_lora_conv1d": ("NotImplementedError", "Leave conv1d out of PEFT's target_modules"),
    # accelerate's own refusal, its message
    "disabled_section": ("ValueError", "Sequence parallelism does not support attention layers of type"),
    "without_enable": ("ValueError", "Sequence parallelism does not support attention layers of type"),
}


@pytest.mark.parametrize("case", list(EXPECTED_ERRORS))
def test_refusals_on_every_rank(runs, case):
    _, sp = runs
    kind, text = EXPECTED_ERRORS[case]
    messages = [run["errors"][case] for run in sp]
    for m in messages:
        assert m.startswith(kind) and text in m, messages


def test_unwrapped_linear_attention_keeps_accelerate_refusal():
    """With enable(), a model with linear_attention layers but none of the six mixers gets accelerate's refusal."""
    import accelerate.accelerator as accelerator_mod
    from transformers import PretrainedConfig

    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    model = torch.nn.Linear(2, 2)
    model.config = PretrainedConfig(layer_types=["linear_attention", "full_attention"])
    mamba_sp.enable()
    try:
        with pytest.raises(ValueError, match="Sequence parallelism does not support attention layers"):
            accelerator_mod._refuse_recurrent_layers_under_sequence_parallelism(copy.copy(model))
    finally:
        mamba_sp.disable()
    assert not mamba_sp.enabled()


@pytest.mark.parametrize("family", list(hf_models.DELTA_MODULES))
def test_gated_deltanet_families_are_covered(family):
    """enable() lets the Gated DeltaNet families past accelerate's refusal of linear_attention layers (they are
    prepared by prepare_sequence_parallel, tests/test_hf.py); a model without them is not covered."""
    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    assert mamba_sp._holds_mixers(hf_models.build(family))
    assert not mamba_sp._holds_mixers(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------
# GPU (marker gpu)
# ---------------------------------------------------------------------------------------------------
# The Trainer under accelerate's DeepSpeed sequence parallelism on one GPU (marker ``gpu``; skipped without
# CUDA): Falcon-H1 at cp=2, the two ranks sharing the GPU through gloo, against the same script with sp_size 1 in
# one process, and the negative control (accelerate alone). The CPU test (tests/test_accelerate.py) says what is
# compared; here both runs take transformers' GPU path where it is unsharded (mamba-ssm's fused kernel, loaded
# before the models, as tests/test_hf_gpu.py does) and this package's Triton backend where it is sharded.
#
# MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q -s tests/test_accelerate.py
#
# Bound 5e-3 relative on the losses, grad_norms and updates: fp32 parameters, but mamba-ssm's Triton kernels
# (the reference's and the sharded run's, chunked differently) multiply in TF32 (10-bit mantissa, ~5e-4 per
# product), so two fp32 runs that sum in another order differ by ~1e-3; the negative control (a lost state,
# gradients 2x at ZeRO-2) is off by O(1) and must exceed 10x the bound.

GPU_TOL = 5e-3
FAMILY, STAGE = "falcon_h1", 2


def _gpu_runs(rank, world, tmp):
    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    sp = world
    out = {}
    if sp > 1:
        mamba_sp.enable()
    out["run"] = _train(FAMILY, STAGE, sp, os.path.join(tmp, f"run{sp}"), sizes=hf_models.GPU_SIZES, use_cpu=False)
    out["fixed"] = None
    if sp == 1:  # the negative control's reference (DeepSpeed's own adapter needs equal lengths on gloo)
        out["fixed"] = _train(
            FAMILY, STAGE, 1, os.path.join(tmp, "fixed1"), fixed_collate, sizes=hf_models.GPU_SIZES, use_cpu=False
        )  # fmt: skip
    else:
        import deepspeed.comm as dist
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"].__dict__.get("_ds_mamba_spcp_core_attention")
        mamba_sp.disable()
        dist.barrier()
        parallel_state_sp._release_sequence_parallel_groups()
        if core_sdpa is not None:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = core_sdpa
        out["fixed"] = _train(
            FAMILY, STAGE, sp, os.path.join(tmp, "bug"), fixed_collate, sizes=hf_models.GPU_SIZES, use_cpu=False
        )  # fmt: skip
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it through gloo)")
def test_trainer_on_one_gpu(tmp_path):
    ref = run_ranks(_gpu_runs, 1, str(tmp_path / "ref"), backend="gloo-cuda", timeout=1200)[0]
    sp = run_ranks(_gpu_runs, 2, str(tmp_path / "sp"), backend="gloo-cuda", timeout=1200)
    for rank, out in enumerate(sp):
        err = _errors(out["run"], ref["run"])
        bug = _errors(out["fixed"], ref["fixed"])
        print(f"{FAMILY} ZeRO-{STAGE} cp=2 rank {rank}: {err}; negative control: {bug}")
        assert err["loss"] <= GPU_TOL and err["grad_norm"] <= GPU_TOL and err["update"] <= GPU_TOL, err
        assert bug["update"] > 10 * GPU_TOL, bug
        assert abs(out["run"]["eval_loss"] - ref["run"]["eval_loss"]) <= GPU_TOL * abs(ref["run"]["eval_loss"])
