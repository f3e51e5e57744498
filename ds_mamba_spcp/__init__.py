"""ds_mamba_spcp: state-passing sequence parallelism for Mamba2 under DeepSpeed."""

__version__ = "0.1.0"
