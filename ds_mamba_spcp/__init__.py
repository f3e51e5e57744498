"""ds_mamba_spcp: state-passing sequence parallelism for Mamba2 under DeepSpeed."""

from ds_mamba_spcp.delta_op import chunk_gated_delta_rule_sp
from ds_mamba_spcp.engine.layout import shard_sequence, unshard_sequence
from ds_mamba_spcp.groups import resolve_sequence_process_group
from ds_mamba_spcp.module import DistributedMamba2, wrap_mamba2_mixers
from ds_mamba_spcp.op import mamba_split_conv1d_scan_sp, mamba_split_conv1d_scan_ulysses
from ds_mamba_spcp.ops.reference import mamba_split_conv1d_scan_ref

__version__ = "0.1.0"

__all__ = [
    "DistributedMamba2",
    "chunk_gated_delta_rule_sp",
    "mamba_split_conv1d_scan_ref",
    "mamba_split_conv1d_scan_sp",
    "mamba_split_conv1d_scan_ulysses",
    "resolve_sequence_process_group",
    "shard_sequence",
    "unshard_sequence",
    "wrap_mamba2_mixers",
]
