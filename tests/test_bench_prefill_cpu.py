"""benchmarks/bench_prefill.py's CPU path (the GPU run is the lead's): the JSON schema, the Markdown table,
and the chunked prefill's logits against the whole prompt's within fp32 roundoff (1e-5 relative: the tiles
cut the chunked scan at other places, ~1e-7; a lost carry is O(1), tests/test_prefill_mamba.py)."""

from __future__ import annotations

import json

from tests.dist_utils import load_script


def test_bench_prefill_cpu_path(tmp_path):
    bench = load_script("benchmarks", "bench_prefill.py")
    out = tmp_path / "prefill_cpu.json"
    modes = ",".join(bench.MODES + bench.EXTRA_MODES)
    bench.main(["--device", "cpu", "--presets", "tiny", "--lengths", "48", "--chunked-lengths", "96", "--tile", "20",
                "--repeats", "1", "--modes", modes, "--out", str(out)])  # fmt: skip
    payload = json.loads(out.read_text())
    assert payload["schema"] == bench.SCHEMA and payload["complete"]
    status = {(r["seqlen"], r["mode"]): r["status"] for r in payload["records"]}
    assert status == {
        (48, "hf_forward"): "ok", (48, "mamba_ssm_forward"): "skipped", (48, "mamba_ssm_prefill"): "skipped",
        (48, "ours_whole"): "ok", (48, "ours_chunked"): "ok", (96, "ours_chunked"): "ok",
        (48, "ours_whole_training_route"): "ok", (48, "ours_tiled"): "ok", (48, "ours_tiled_training_route"): "ok",
    }  # fmt: skip
    # the model is mamba-ssm's own MambaLMHeadModel (CPU flags), and every ours_* mode gives the whole prompt's logits
    for mode in ("ours_whole_training_route", "ours_tiled", "ours_tiled_training_route"):
        rec = next(r for r in payload["records"] if r["mode"] == mode)
        assert rec["logits_err"] <= 1e-5, rec
    chunked = next(r for r in payload["records"] if r["mode"] == "ours_chunked" and r["seqlen"] == 48)
    assert chunked["logits_err"] <= 1e-5 and chunked["tokens_per_s"] > 0
    text = (tmp_path / "prefill_cpu.md").read_text()
    assert "| tiny | 48 | ours_chunked | ok |" in text and "Longest chunked prefill, tiny: 96 tokens." in text
