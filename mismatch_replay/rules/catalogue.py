"""The catalogue as users read it: plain records (`mismatch-replay rules`) and the two
Markdown tables docs/rules.md carries (the rules, and every preset with its arithmetic and
where it was read; docs/gen_reference.py writes them from `rules --json`, and tests keep the
page equal to them). Rules appear in REGISTRY's order.
"""

from __future__ import annotations

from .base import REGISTRY, Rule
from .cost import direction_of


def catalogue() -> list[type[Rule]]:
    return list(REGISTRY.values())


def catalogue_records() -> list[dict]:
    """The catalogue as plain records (what `mismatch-replay rules` prints)."""
    recs = []
    for cls in REGISTRY.values():
        defaults = cls.defaults()
        recs.append(
            {
                "name": cls.name,
                "title": cls.title,
                "level": cls.level,
                "kind": cls.kind,
                "needs": list(cls.needs),
                "definition": cls.definition,
                "masks_updates": direction_of(cls.name),  # what a mask costs (cost.py)
                "source": cls.source,
                "params": [
                    {
                        "name": p.name,
                        "default": defaults[p.name],
                        "doc": p.doc,
                        "grid": p.grid,
                        "threshold": p.threshold,
                        "domain": p.domain.text(),
                    }
                    for p in cls.params
                ],
                "presets": {k: dict(v) for k, v in cls.presets.items()},
                "preset_notes": dict(cls.preset_notes),
                "preset_quirks": dict(cls.preset_quirks),
                "preset_arith": {k: v for k, v in cls.preset_arith.items() if v},
                "preset_sources": dict(cls.preset_sources),
                # the precision each preset replays in by default, and where it was read
                "preset_precision": {k: cls.native_precision(k) for k in cls.presets},
                "preset_precision_sources": {k: cls.precision_source(k) for k in cls.presets},
            }
        )
    return recs


def catalogue_markdown(records: list[dict] | None = None) -> str:
    """The catalogue as the Markdown table docs/rules.md carries (a test keeps them equal);
    `records` (default: `catalogue_records()`) may be what `rules --json` printed."""

    def num(v) -> str:
        return "—" if v is None else f"{v:g}"

    lines = [
        "| rule | level | masked (or truncated) when | parameters (default) | presets | source |",
        "|---|---|---|---|---|---|",
    ]
    for r in catalogue_records() if records is None else records:
        params = ", ".join(f"`{p['name']}`={num(p['default'])}" for p in r["params"])
        presets = "; ".join(
            (f"`@{k}` " + ",".join(f"{a}={num(b)}" for a, b in v.items())).rstrip()
            + (f" ({r['preset_arith'][k]})" if k in r["preset_arith"] else "")
            for k, v in r["presets"].items()
        )
        kind = "weight" if r["kind"] == "weight" else r["level"]
        needs = f" (needs {', '.join(r['needs'])})" if r["needs"] else ""
        definition = r["definition"].replace("|", "\\|")
        lines.append(
            f"| `{r['name']}` | {kind} | {definition}{needs} | {params} | {presets or '—'} "
            f"| {r['source']} |"
        )
    return "\n".join(lines)


def presets_markdown(records: list[dict] | None = None) -> str:
    """Every preset with its arithmetic and where it was read (docs/rules.md; a test keeps
    them equal); `records` as for `catalogue_markdown`."""
    lines = [
        "| preset | values | arithmetic | read from |",
        "|---|---|---|---|",
    ]
    for r in catalogue_records() if records is None else records:
        for k, v in r["presets"].items():
            vals = ",".join(f"{a}={'—' if b is None else f'{b:g}'}" for a, b in v.items())
            arith = r["preset_arith"].get(k, "")
            note = r["preset_notes"].get(k, "")
            how = f"`{arith}`: {note}" if arith else (note or "the bare rule's arithmetic")
            src = r["preset_sources"].get(k, "— (no code: the paper or docs' values)")
            how = how.replace("|", "\\|")
            lines.append(f"| `{r['name']}@{k}` | {vals or 'defaults'} | {how} | {src} |")
    return "\n".join(lines)
