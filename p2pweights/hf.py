"""``p2pweights.hf``: the public name of the transformers loader, ``p2pweights.loaders.hf`` (the same module)."""
import sys

from .loaders import hf as _hf

sys.modules[__name__] = _hf
