"""Config out: the chosen threshold, written as the override the trainer itself reads.

Design
------
`emit(framework, choices, base)` turns `analysis.choose`'s choices (or rule SPECs) into text in
the framework's own syntax:

* `toml`  a `[trainer.loss]` table (prime-rl);
* `hydra` one override per line, `key=value`, joined with ` \\` so the block pastes into a
  training command (verl, NeMo-RL, SkyRL, AReaL); string values that are not plain names are
  quoted for Hydra (`'0.31_2.0'`) and the whole token for the shell (`"k='a,b'"`);
* `yaml`  the nested mapping (AReaL's default, also verl, NeMo-RL, SkyRL, TRL);
* `cli`   argparse flags (`--use-tis --tis-clip 2.5`: slime, TRL, OpenRLHF, prime-rl).

Each choice is one block that changes only what was chosen: the rule's slot in the base
config (read with `--from-config`) gets the chosen rule, and the block writes the keys that
select that rule (those `write` gives for the rule alone) plus any other key whose value
differs from the base's. So a rejection threshold never rewrites verl's
`rollout_is_threshold`; reading the block back alone (`config_in.read_text`) gives the chosen
rule, and merged over the base config, the base's rules with that one replaced: the round
trip the tests run for every framework. A value with a bootstrap interval is written with
the fewest digits that stay inside it (`_rounded`: 1.05, not 1.0495847307869384, for an
interval 1.048 .. 1.051), in the form the framework writes (for verl's `*_k1` pairs, the
reciprocal is the short one); without an interval, as its shortest exact decimal (`repr`),
and derived keys (verl's reciprocal `lower_upper` bounds) exact to the last bit or one ulp.
Notes are those of the chosen rule's own keys (`write` of the rule alone).

Rows whose search ended out of range are skipped with a comment: there is no threshold to
write. A rule the framework cannot express (IPO in verl) gets a comment saying so, and the
other blocks are written; only when no block can be written is it an error. A header
comment per block says what the setting masks on the replayed log.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from ..rules import Rule, parse_rule
from .config_in import TrainerConfig, unflatten, yaml_module
from .frameworks import Framework, get_framework
from .frameworks.base import float_text

SYNTAXES = ("toml", "yaml", "hydra", "cli")
_PLAIN = re.compile(r"^[A-Za-z_][\w\-]*$")


def parse_target(text: str) -> tuple[str, str | None]:
    """`verl`, `verl:yaml` -> (framework, syntax or None)."""
    name, _, syntax = text.partition(":")
    return get_framework(name).name, (syntax.strip().lower() or None)


def check_target(text: str, syntax: str | None = None) -> tuple[str, str]:
    """Validate an `--emit FRAMEWORK[:SYNTAX]` before any pass over the log; returns
    (framework, syntax)."""
    name, inline = parse_target(text)
    fw = get_framework(name)
    syntax = (syntax or inline or fw.syntaxes[0]).lower()
    if syntax not in fw.syntaxes:
        raise UsageError(
            f"--emit {text}: {fw.title} configs are written as "
            f"{' or '.join(fw.syntaxes)}, not {syntax}."
        )
    return name, syntax


# ----------------------------------------------------------------------------- values


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return float_text(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def _hydra_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return float_text(v)
    if isinstance(v, list | tuple):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in ("null", "none", "true", "false"):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _shell(token: str) -> str:
    if re.fullmatch(r"[\w.\-+=/:,]+", token):
        return token
    if "'" in token and '"' not in token and "$" not in token:
        return f'"{token}"'
    return "'" + token.replace("'", "'\"'\"'") + "'"


def _cli_value(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return float_text(v)
    if isinstance(v, int):
        return str(v)
    return _shell(str(v))


def format_pairs(pairs: Sequence[tuple[str, Any]], syntax: str, fw: Framework) -> str:
    """(dotted key, value) pairs -> text in one syntax."""
    if syntax == "toml":
        lines: list[str] = []
        current = None
        for key, value in pairs:
            table, _, leaf = key.rpartition(".")
            if value is None:
                continue  # TOML has no null: an unset key is the framework's default
            if table != current:
                if lines:
                    lines.append("")
                lines.append(f"[{table}]")
                current = table
            lines.append(f"{leaf} = {_toml_value(value)}")
        return "\n".join(lines)
    if syntax == "yaml":
        tree = unflatten(pairs)
        return yaml_module().safe_dump(tree, sort_keys=False, default_flow_style=False).rstrip()
    if syntax == "hydra":
        return " \\\n".join(_shell(f"{k}={_hydra_value(v)}") for k, v in pairs)
    if syntax == "cli":
        parts = []
        for key, value in pairs:
            flag = fw.flag_text(key)
            if fw.is_switch(key):
                if value:
                    parts.append(flag)
                continue
            if value is None:
                continue
            if isinstance(value, list | tuple):
                parts.append(f"{flag} " + " ".join(_cli_value(x) for x in value))
            else:
                parts.append(f"{flag} {_cli_value(value)}")
        return " \\\n".join(parts)
    raise UsageError(f"unknown syntax '{syntax}': use one of {', '.join(SYNTAXES)}.")


# ----------------------------------------------------------------------------- emit


def _as_rule(choice) -> tuple[Rule, dict]:
    """A SPEC, a Rule, an `analysis.Choice` or its dict -> (the rule, the choice's fields)."""
    if isinstance(choice, Rule):
        return choice, {}
    if isinstance(choice, str):
        return parse_rule(choice), {}
    if hasattr(choice, "to_dict"):  # an analysis.Choice
        choice = choice.to_dict()
    if isinstance(choice, dict) and "spec" in choice:
        return parse_rule(choice["spec"]), choice
    raise UsageError(f"emit: {choice!r} is neither a rule SPEC nor a choose result row.")


def combine(fw: Framework, base: Sequence[Rule], rule: Rule) -> list[Rule]:
    """The base config's rules with `rule` in its slot (replacing the rule held there)."""
    if rule.name not in fw.slots:
        raise fw.cannot(rule)
    slot = fw.slot(rule.name)
    out: list[Rule] = []
    placed = False
    for r in base:
        if fw.slot(r.name) == slot:
            if not placed:
                out.append(rule)
                placed = True
            continue
        out.append(r)
    if not placed:
        out.append(rule)
    return out


def _interval(row: dict) -> tuple[float, float] | None:
    """The bootstrap interval of a chosen threshold (None: no target, or no bootstrap)."""
    lo, hi = row.get("ci_low"), row.get("ci_high")
    if row.get("target_fraction") is None or lo is None or hi is None:
        return None
    return float(min(lo, hi)), float(max(lo, hi))


def _rounded(fw: Framework, rule: Rule, row: dict) -> Rule:
    """The chosen rule with its threshold written with the fewest characters that keep it
    inside its bootstrap interval (`_interval`; the rule as it is without one). Candidates
    at 1 to 17 significant digits, of the value and of its reciprocal (what verl's `*_k1`
    pair writes), the shortest of what `fw.write` makes of them wins."""
    param, ci = row.get("param"), _interval(row)
    value = getattr(rule, param, None) if param else None
    if ci is None or value is None or not ci[0] <= value <= ci[1]:
        return rule
    best, best_len = rule, None
    for digits in range(1, 18):
        cands = [float(f"{value:.{digits}g}")]
        if value != 0:
            with_inv = float(f"{1.0 / value:.{digits}g}")
            cands += [1.0 / with_inv] if with_inv != 0 else []
        for c in cands:
            if not ci[0] <= c <= ci[1]:
                continue
            try:
                cand = rule.replace(**{param: c})
                size = sum(len(str(v)) for _, v in fw.write([cand], {})[0])
            except UsageError:
                continue
            if best_len is None or size < best_len:  # ties: the fewer digits
                best, best_len = cand, size
    return best


def _header(rule: Rule, row: dict) -> list[str]:
    if not row:
        return [f"# mismatch-replay: {rule.spec()}"]
    what = "truncates" if row.get("kind") == "weight" else "masks"
    frac = row.get("masked_fraction")
    name = rule.spec().partition(":")[0]
    param = row.get("param")
    written = getattr(rule, param, None) if param else None
    line = f"# mismatch-replay choose: {name} {param}={float_text(row['value'])}"
    if frac is not None:
        line += f" {what} {100 * frac:.3g}% of {row.get('tokens', 0):,} loss tokens"
    if row.get("target_fraction") is not None:
        line += f" (target {100 * row['target_fraction']:.3g}%)"
    out = [line]
    if row.get("ci_low") is not None and row.get("ci_high") is not None:
        lo, hi = row["ci_low"], row["ci_high"]
        if row.get("target_fraction") is None:  # choose without -t: the fraction's interval
            done = "truncated" if row.get("kind") == "weight" else "masked"
            out.append(
                f"#   95% interval of the {done} fraction: {100 * lo:.3g}% .. {100 * hi:.3g}%"
            )
        else:
            out.append(f"#   95% interval of the threshold: {lo:.4g} .. {hi:.4g}")
    if written is not None and written != row["value"]:
        out.append("#   written with the fewest digits that stay inside that interval")
    if row.get("status") not in (None, "ok"):
        out.append(
            f"#   status: {row['status']}" + (f" ({row['note']})" if row.get("note") else "")
        )
    out.append(f"#   rule: {rule.spec()}")
    return out


def emit(
    framework: str,
    choices: Sequence,
    base: TrainerConfig | None = None,
    syntax: str | None = None,
) -> str:
    """The override(s) that set each chosen threshold, in the framework's own syntax.

    `framework`: a name of `frameworks.FRAMEWORKS`, optionally `NAME:SYNTAX` (`verl:yaml`).
    `choices`: `analysis.choose`'s choices (or their dicts), rule SPECs or Rules; one block per
    choice, separated by a blank line. `base`: the config the rules came from
    (`read_config`); its other rules are kept in each block. `syntax`: toml, yaml, hydra or
    cli (default: the framework's usual one).
    """
    name, syntax = check_target(framework, syntax)
    fw = get_framework(name)
    if base is not None and base.framework != fw.name:
        raise UsageError(
            f"--emit {fw.name}: the --from-config file is a {base.framework} config; emit "
            f"{base.framework}, or drop --from-config."
        )
    base_rules = [cr.rule for cr in base.rules] if base else []
    values = base.values if base else {}
    before = dict(fw.write(base_rules, values)[0]) if base_rules else {}
    blocks, refused = [], []
    for choice in choices:
        rule, row = _as_rule(choice)
        if row.get("status") == "out of range":
            blocks.append(
                f"# mismatch-replay choose: {rule.name} {row.get('param')}: no threshold "
                f"reaches the target ({row.get('note') or 'out of range'}); nothing to write."
            )
            continue
        try:
            rule = _rounded(fw, rule, row)
            own, notes = fw.write([rule], {})  # the keys (and notes) of this rule alone
            pairs, _ = fw.write(combine(fw, base_rules, rule), values)
        except UsageError as exc:
            refused.append(str(exc))
            blocks.append(f"# mismatch-replay: {rule.spec()}: not written: {exc}")
            continue
        keys = {k for k, _ in own}
        missing = object()
        pairs = [(k, v) for k, v in pairs if k in keys or before.get(k, missing) != v]
        lines = _header(rule, row) + [f"#   note: {n}" for n in notes]
        blocks.append("\n".join([*lines, format_pairs(pairs, syntax, fw)]))
    if refused and len(refused) == len(blocks):
        raise UsageError(refused[0] if len(refused) == 1 else "; ".join(dict.fromkeys(refused)))
    return "\n\n".join(blocks) + "\n"


def assignments(framework: str, rules: Sequence[str | Rule]) -> list[tuple[str, Any]]:
    """The (dotted key, value) pairs that select `rules` in a framework (no formatting)."""
    fw = get_framework(framework)
    out: list[Rule] = []
    for r in rules:
        out = combine(fw, out, _as_rule(r)[0])
    return fw.write(out, {})[0]


__all__ = [
    "SYNTAXES",
    "assignments",
    "check_target",
    "combine",
    "emit",
    "format_pairs",
    "parse_target",
]
