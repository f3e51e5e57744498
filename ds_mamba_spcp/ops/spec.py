"""The mixer core's static description, inferred once from the op's arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoreSpec:
    """Sizes and options of one Mamba2 mixer core call (mamba-ssm's names)."""

    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    d_conv: int
    chunk_size: int
    dt_limit: tuple = (0.0, float("inf"))
    activation: str | None = "silu"
    rmsnorm_eps: float = 1e-6
    norm_before_gate: bool = False

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.dstate

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.dstate + self.nheads

    @classmethod
    def infer(
        cls,
        zxbcdt,
        conv1d_weight,
        D,
        chunk_size,
        *,
        headdim,
        ngroups,
        dt_limit=(0.0, float("inf")),
        activation="silu",
        rmsnorm_eps=1e-6,
        norm_before_gate=False,
    ) -> CoreSpec:
        """Reads the sizes off the tensors and raises a sentence for any that do not fit."""
        if zxbcdt.dim() != 3:
            raise ValueError(f"zxbcdt must be (batch, seqlen, channels), got shape {tuple(zxbcdt.shape)}")
        if conv1d_weight.dim() != 2:
            raise ValueError(f"conv1d_weight must be (conv_dim, d_conv), got {tuple(conv1d_weight.shape)}")
        if D.dim() == 2:
            nheads, d_headdim = D.shape
            if headdim is not None and headdim != d_headdim:
                raise ValueError(f"D has shape {tuple(D.shape)} but headdim={headdim}")
            headdim = d_headdim
        elif D.dim() == 1:
            (nheads,) = D.shape
            if headdim is None:
                raise ValueError("headdim must be given when D is 1-D (nheads,)")
        else:
            raise ValueError(f"D must be (nheads,) or (nheads, headdim), got {tuple(D.shape)}")
        if ngroups < 1 or nheads % ngroups != 0:
            raise ValueError(f"nheads={nheads} must be a multiple of ngroups={ngroups}")
        conv_dim, d_conv = conv1d_weight.shape
        d_inner = nheads * headdim
        if (conv_dim - d_inner) <= 0 or (conv_dim - d_inner) % (2 * ngroups) != 0:
            raise ValueError(
                f"conv1d_weight has {conv_dim} channels; expected nheads*headdim + 2*ngroups*dstate "
                f"= {d_inner} + 2*{ngroups}*dstate"
            )
        dstate = (conv_dim - d_inner) // (2 * ngroups)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        spec = cls(
            nheads=nheads,
            headdim=headdim,
            ngroups=ngroups,
            dstate=dstate,
            d_conv=d_conv,
            chunk_size=chunk_size,
            dt_limit=tuple(dt_limit),
            activation=activation,
            rmsnorm_eps=rmsnorm_eps,
            norm_before_gate=norm_before_gate,
        )
        width = zxbcdt.shape[-1]
        if width != spec.d_in_proj:
            extra = width - spec.d_in_proj
            if extra > 0 and extra % 2 == 0:
                raise NotImplementedError(
                    f"zxbcdt has {extra} channels beyond z, xBC and dt (mamba-ssm's d_nonssm MLP part, "
                    "Mamba2(d_ssm < d_inner)); the sequence-parallel op does not support it yet"
                )
            raise ValueError(
                f"zxbcdt has {width} channels; expected 2*d_inner + 2*ngroups*dstate + nheads = "
                f"{spec.d_in_proj} (d_inner={d_inner}, ngroups={ngroups}, dstate={dstate}, nheads={nheads})"
            )
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
        return spec


def split_zxbcdt(zxbcdt: torch.Tensor, spec: CoreSpec):
    """(batch, seqlen, d_in_proj) -> z (.., d_inner), xBC (.., conv_dim), dt (.., nheads)."""
    return torch.split(zxbcdt, [spec.d_inner, spec.conv_dim, spec.nheads], dim=-1)
