"""Speculative decoding: tokens proposed by prompt lookup (`ngram`) or a draft model (`draft`), verified
by the target in one step (`verify`), where the measured cost says it pays (`policy`); the engine's
side of it is `speculator`."""

from stratum.engine.spec_decode.speculator import MODES, SpecConfig, Speculator, SpecState, verify_refusal
from stratum.engine.spec_decode.verify import verify

__all__ = ["MODES", "SpecConfig", "SpecState", "Speculator", "verify", "verify_refusal"]
