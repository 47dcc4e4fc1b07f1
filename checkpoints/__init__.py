"""The shipped SFT checkpoints: package data, one folder per cache name (``<model>-sft-<key>``) with the
checkpoint's files and its ``SHA256SUMS`` (``streamrl.sft.SHIPPED``, ``docs/sft.md``)."""
