"""What reading a trainer config gives: the flat `Settings` and the `TrainerConfig`.

Design
------
`config_in` turns files into `Settings` (flat dotted keys -> values, remembering which file
set each key, with Hydra's semantics for setting and deleting a key) and hands them to a
framework (`frameworks`), whose `read` returns a `TrainerConfig`: the catalogue rules the
config selects, each a `ConfigRule` with the keys it was read from. Both sides import these
types from here, so that `config_in` may import the frameworks registry without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConfigRule:
    """One rule read from a config: the catalogue rule, and where it came from."""

    rule: Any  # a rules.Rule instance
    keys: dict[str, str]  # rule parameter -> the framework key it was read from
    origin: str  # the setting as the framework writes it, e.g. "rollout_rs=token_k1"
    notes: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return self.rule.spec()

    def to_dict(self) -> dict:
        return {"spec": self.spec, "origin": self.origin, "keys": self.keys, "notes": self.notes}


@dataclass
class TrainerConfig:
    """The rules a trainer config selects, with the keys as read (after merging files)."""

    framework: str
    files: list[str]
    rules: list[ConfigRule]
    values: dict[str, Any]  # the framework's own keys (dotted) that the files set
    notes: list[str] = field(default_factory=list)

    def specs(self) -> list[str]:
        return [r.spec for r in self.rules]

    def all_notes(self) -> list[str]:
        """The config's notes and each rule's, in order (what a CLI prints on stderr)."""
        return [*self.notes, *(n for r in self.rules for n in r.notes)]

    def to_dict(self) -> dict:
        return {
            "framework": self.framework,
            "files": self.files,
            "rules": [r.to_dict() for r in self.rules],
            "values": self.values,
            "notes": self.notes,
        }


class Settings(dict):
    """Flat dotted keys -> values, remembering which file set each key (for messages)."""

    def __init__(self):
        super().__init__()
        self.where: dict[str, str] = {}

    def assign(self, key: str, value: Any, origin: str) -> None:
        """Hydra-like: setting a key drops its children (and a null parent above it)."""
        for k in [k for k in self if k.startswith(key + ".")]:
            self.pop(k)
            self.where.pop(k, None)
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in self and not isinstance(self[parent], dict):
                self.pop(parent)
                self.where.pop(parent, None)
        self[key] = value
        self.where[key] = origin

    def delete(self, key: str) -> None:
        for k in [k for k in self if k == key or k.startswith(key + ".")]:
            self.pop(k)
            self.where.pop(k, None)

    def under(self, prefix: str) -> dict[str, Any]:
        """The keys below `prefix.` with the prefix removed."""
        n = len(prefix) + 1
        return {k[n:]: v for k, v in self.items() if k.startswith(prefix + ".")}

    def has(self, prefix: str) -> bool:
        return prefix in self or any(k.startswith(prefix + ".") for k in self)

    def origin(self, key: str) -> str:
        return self.where.get(key) or next(iter(self.where.values()), "the config")
