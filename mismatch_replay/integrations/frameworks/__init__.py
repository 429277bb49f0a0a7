"""Each trainer's mismatch-correction keys, mapped both ways onto the rule catalogue.

Design
------
One class per framework, one module each (`prime_rl`, `verl`, `areal`, `trl`, `nemo_rl`,
`slime`, `skyrl`, `openrlhf`), on the `base.Framework` class, each with two inverse halves:

* `read(settings) -> TrainerConfig`: the framework's dotted keys (from `config_in`) -> the
  catalogue rules they select, using the defaults the framework's code uses for a key the
  config leaves out. Every key it does not know in its own sections is an error that names
  the key, the file and the known keys (a typo would otherwise replay a default).
* `write(rules, base) -> [(key, value)]`: a set of rules -> the keys that select them, the
  full set for each rule (the chosen threshold and the others), so that the text `emit`
  prints is self-contained: read back alone it gives the same rules.

A framework holds a few *slots* (verl: one IS weight and any number of rejection options;
AReaL: one `rejection_sampling` and M2PO; prime-rl: one loss); emitting a choice replaces the
rule in the chosen rule's slot and keeps the others of the base config.

Where a framework's arithmetic differs from the rule's plain reading, the mapping follows the
code and says so in a note: verl's `*_k1` options with a "lo_hi" threshold keep
1/hi <= r <= 1/lo; AReaL's `kl_k1` bounds apply to log r; NeMo-RL's `icepop` on
sequence-level ratios is a product-ratio band. Where no catalogue rule replays a setting
(AReaL's `kl_k3`, which is q/p - 1 - log(q/p); verl's `seq_sum_k2`), reading fails and says
so rather than replaying something else.

Each class's `checked` names the repository, files and commit its mapping was read from
(docs/integrations.md prints the same table). `FRAMEWORKS` is the registry, in detection
order; `get_framework` takes a name or an alias.
"""

from __future__ import annotations

from ...errors import UsageError
from .areal import AReaL
from .base import Checked, Framework
from .nemo_rl import NeMoRL
from .openrlhf import OpenRLHF
from .prime_rl import PrimeRL
from .skyrl import SkyRL
from .slime import Slime
from .trl import TRL
from .verl import Verl

FRAMEWORKS: dict[str, Framework] = {
    fw.name: fw
    for fw in (PrimeRL(), Verl(), AReaL(), TRL(), NeMoRL(), Slime(), SkyRL(), OpenRLHF())
}
ALIASES = {"prime": "prime-rl", "primerl": "prime-rl", "nemo": "nemo-rl", "nemorl": "nemo-rl"}


def get_framework(name: str) -> Framework:
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    try:
        return FRAMEWORKS[key]
    except KeyError:
        raise UsageError(f"unknown framework '{name}'; known: {', '.join(FRAMEWORKS)}.") from None


__all__ = ["FRAMEWORKS", "Checked", "Framework", "get_framework"]
