"""A report into TensorBoard event files, and back.

Design
------
`log_to_tensorboard(logdir, outputs)` writes one event file (`events.out.tfevents.*`) with:

* every per-step series as a scalar at its trainer step (`mismatch_replay/kl_k3`,
  `mismatch_replay/masked_fraction/ipo_eps_0.3`, ...), so a user who points TensorBoard at
  the training run's log directory sees the replay beside the training curves;
* the figures as images (their PNG bytes as written, not decoded and re-encoded) at the
  last replayed step;
* text: the chosen thresholds (a Markdown table of the choose rows), the command, the page.

TensorBoard tags take `[A-Za-z0-9_./-]`; a rule SPEC's `:`, `=` and `,` become `_`.

The writer is tensorboardX (the `[tensorboard]` extra): a pure-Python wheel of ~0.1 MB whose
only dependencies are numpy, packaging and protobuf, where `torch.utils.tensorboard` needs
torch, and TensorFlow's writer TensorFlow. Reading back needs no TensorBoard either:
`read_events` parses the TFRecord framing (length, masked CRC-32C of the length, payload,
masked CRC-32C of the payload; both checked) and decodes each payload with tensorboardX's
copy of TensorFlow's `Event` protobuf.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from ..errors import DataError, UsageError
from .outputs import ReportOutputs, series_rows

PREFIX = "mismatch_replay"
_BAD = re.compile(r"[^\w.\-/]")


def _tbx():
    try:
        import tensorboardX
    except ImportError:
        raise UsageError(
            "--tensorboard needs tensorboardX: pip install 'mismatch-replay[tensorboard]'."
        ) from None
    return tensorboardX


def check() -> None:
    """Before any pass over the log: tensorboardX is there."""
    _tbx()


def tag(name: str) -> str:
    """A series name as a TensorBoard tag: `masked_fraction/ipo:eps=0.3` ->
    `mismatch_replay/masked_fraction/ipo_eps_0.3`."""
    return f"{PREFIX}/" + _BAD.sub("_", name)


def _png_size(png: bytes) -> tuple[int, int]:
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise DataError("a figure is not a PNG file; TensorBoard images need PNG.")
    w, h = struct.unpack(">II", png[16:24])
    return w, h


def _markdown(rows: list[dict]) -> str:
    cols = ["rule", "setting", "param", "value", "masked_fraction", "ci_low", "ci_high", "status"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log_to_tensorboard(logdir: str | Path, outputs: ReportOutputs) -> dict:
    """Write the report's series, figures and choices to an event file under `logdir`;
    returns the event file's path and the tags written."""
    tbx = _tbx()
    from tensorboardX.proto.summary_pb2 import Summary

    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    writer = tbx.SummaryWriter(logdir=str(logdir), filename_suffix=".mismatch_replay")
    tags: list[str] = []
    try:
        if outputs.steps is not None:
            for step, vals in series_rows(outputs.steps):
                for name, v in vals.items():
                    t = tag(name)
                    writer.add_scalar(t, v, global_step=step)
                    if t not in tags:
                        tags.append(t)
        last = outputs.last_step or 0
        fw = writer._get_file_writer()
        for name, path in outputs.figures.items():
            png = Path(path).read_bytes()
            w, h = _png_size(png)
            img = Summary.Image(height=h, width=w, colorspace=4, encoded_image_string=png)
            t = tag(f"report/figures/{name}")
            fw.add_summary(Summary(value=[Summary.Value(tag=t, image=img)]), global_step=last)
            tags.append(t)
        texts = {}
        if outputs.choose:
            texts["report/choose"] = _markdown(outputs.choose)
        if outputs.command:
            texts["report/command"] = f"    {outputs.command}"
        if outputs.html is not None:
            texts["report/page"] = f"The HTML report: `{outputs.html}`"
        for name, text in texts.items():
            writer.add_text(tag(name), text, global_step=last)
            tags.append(tag(name))
        writer.flush()
    finally:
        writer.close()
    written = sorted(
        logdir.glob("events.out.tfevents.*.mismatch_replay"), key=lambda p: p.stat().st_mtime
    )
    event_file = str(written[-1]) if written else None
    return {"logdir": str(logdir), "event_file": event_file, "tags": tags}


# ----------------------------------------------------------------------------- reading back


def iter_records(path: str | Path):
    """The payloads of a TFRecord file, each framing checked with its masked CRC-32C."""
    from tensorboardX.record_writer import masked_crc32c

    data = Path(path).read_bytes()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise DataError(f"{path}: truncated record header at byte {pos}.")
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if masked_crc32c(header) != hcrc:
            raise DataError(f"{path}: the record length at byte {pos} fails its checksum.")
        payload = data[pos + 12 : pos + 12 + length]
        if len(payload) < length or pos + 16 + length > len(data):
            raise DataError(f"{path}: truncated record at byte {pos}.")
        (dcrc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        if masked_crc32c(payload) != dcrc:
            raise DataError(f"{path}: the record at byte {pos} fails its checksum.")
        yield payload
        pos += 16 + length


def read_events(logdir: str | Path) -> dict:
    """Every event file under `logdir` read back: {"files", "scalars": {tag: [(step,
    value)]}, "images": {tag: [{"step", "width", "height", "png"}]}, "texts": {tag: [(step,
    text)]}}."""
    _tbx()
    from tensorboardX.proto.event_pb2 import Event

    root = Path(logdir)
    files = sorted(root.rglob("events.out.tfevents.*")) if root.is_dir() else [root]
    if not files:
        raise DataError(f"{root}: no TensorBoard event files (events.out.tfevents.*).")
    scalars: dict[str, list] = {}
    images: dict[str, list] = {}
    texts: dict[str, list] = {}
    for f in files:
        for payload in iter_records(f):
            ev = Event.FromString(payload)
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    scalars.setdefault(v.tag, []).append((int(ev.step), float(v.simple_value)))
                elif kind == "image":
                    images.setdefault(v.tag, []).append(
                        {
                            "step": int(ev.step),
                            "width": v.image.width,
                            "height": v.image.height,
                            "png": v.image.encoded_image_string,
                        }
                    )
                elif kind == "tensor" and v.metadata.plugin_data.plugin_name == "text":
                    text = b"".join(v.tensor.string_val).decode("utf-8")
                    texts.setdefault(v.tag, []).append((int(ev.step), text))
    return {"files": [str(f) for f in files], "scalars": scalars, "images": images, "texts": texts}


__all__ = ["PREFIX", "check", "iter_records", "log_to_tensorboard", "read_events", "tag"]
