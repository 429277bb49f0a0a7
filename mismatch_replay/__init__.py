"""mismatch-replay: replay logged trainer/inference token probabilities through every
masking rule (IPO, IcePop, KPop, DPPO, TIS, sequence rules, ...) across threshold sweeps.

The library is layered (DESIGN.md): `io` reads logs into the canonical token table, `rules`
is the catalogue, `engine` streams batches into an additive Tally, `tables`/`metrics` turn it
into tables, `analysis` answers questions over it, `plots` draws, `cli` formats.
Heavy modules are imported on first use so that `mismatch-replay --help` starts fast.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
