r"""Plots from matmul_rs_bench.py JSON results (matplotlib, Agg backend).

  python experiments/plot_results.py \
      --results='experiments/results/multi_gpu_*.json' --out_dir=experiments/plots

Per results file `<stem>.json`, writes to --out_dir:
  multi_gpu / smoke:
    <stem>_efficiency.png  E per shape and implementation, with the 0.9 target.
    <stem>_times.png       T_gemm, T_comm, T_seq, T_fused (each implementation)
                           and the ideal max(T_gemm, T_comm) per shape.
  single_gpu:
    <stem>_local_ratio.png T_fused / T_xla of the D = 1 GEMM per shape.
    <stem>_loopback.png    loopback GEMM-only, reference and fused times.
  model_bench.py results (the TP block end to end):
    <stem>_block.png       per (M, pass): T(xla) / T(impl) per implementation, and the share
                           of the block's time its communication still exposes.
    <stem>_layers.png      (--per_layer runs) per (M, pass): the XLA block's exposed
                           communication by projection, T(xla) - T(xla without its collectives).
Plots of host-wall-clock (smoke) results are titled "NO PERFORMANCE CLAIMS".
Files of other schemas (autotune, numerics, probe, check JSONs) are skipped with one printed
line each.
"""
from __future__ import annotations

from collections.abc import Sequence
import glob
import json
import os
from pathlib import Path

from absl import app
from absl import flags
from absl import logging
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from bench_records import BASELINES  # pylint: disable=g-import-not-at-top,wrong-import-position
from bench_records import RESOLVED_MODES  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("results", "experiments/results/*.json",
                    "Glob of results JSON files.")
flags.DEFINE_string("out_dir", "experiments/plots", "Where PNGs go.")
flags.DEFINE_float("target", 0.9, "The overlap-efficiency target line.")



def _median(record):
  if record.get("status") != "ok" or not record.get("timing"):
    return None
  return record["timing"]["stats"]["median"]


def _by_shape(records):
  shapes: dict[str, dict[str, dict]] = {}
  for r in records:
    shapes.setdefault(r["shape"]["name"], {})[r["implementation"]] = r
  return shapes


def _title(doc, what):
  env = doc.get("environment", {})
  claims = "" if doc.get("performance_claims") else "  [NO PERFORMANCE CLAIMS]"
  return (f"{what} - {doc.get('mode')} {env.get('device_kind')} "
          f"x{env.get('device_count')} ({doc.get('timer')}){claims}")


def _save(fig, path: Path) -> Path:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

# Legend names for the records' implementation names.
LEGEND_NAMES = {
    "fused": "fused kernel (T_fused)", "xla": "XLA dot + reduce-scatter", "auto": "auto",
    "xla_windowed_einsum": "XLA windowed einsum", "T_gemm": "GEMM alone (T_gemm)",
    "T_comm": "reduce-scatter alone (T_comm)", "T_seq": "GEMM then reduce-scatter (T_seq)",
    "loopback_gemm": "stacked GEMMs only", "loopback_reference": "unfused, emulated",
    "loopback_fused": "fused kernel, loopback",
}


def _bar_groups(ax, labels, series: dict[str, list], ylabel, intervals=None):
  """Grouped bars; `intervals[name]`: per label an (lo, hi) drawn as an error bar, or None."""
  x = np.arange(len(labels))
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    vals = [np.nan if v is None else v for v in values]
    label = LEGEND_NAMES.get(name, LEGEND_NAMES.get(name.removeprefix("T_"), name))
    spans = (intervals or {}).get(name)
    yerr = None
    if spans and any(spans):
      yerr = np.array([[np.nan, np.nan] if c is None or v is None else [v - c[0], c[1] - v]
                       for v, c in zip(values, spans)]).T.clip(min=0)
    ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=label, yerr=yerr,
           capsize=2, error_kw={"linewidth": 0.8})
  ax.set_xticks(x)
  ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
  ax.set_xlabel("shape (model_projection_m<tokens>)", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=7)


def plot_sharded(doc, stem: str, out_dir: Path) -> list[Path]:
  """E per shape with the target line; time breakdown per shape."""
  shapes = _by_shape(doc["records"])
  labels = list(shapes)
  impls = sorted({i for recs in shapes.values() for i in recs
                  if i not in BASELINES})
  written = []
  fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(labels) + 3), 4.5))
  mets = {i: [shapes[s].get(i, {}).get("metrics") or {} for s in labels] for i in impls}
  series = {i: [m.get("overlap_efficiency") for m in mets[i]] for i in impls}
  spans = {i: [m.get("overlap_efficiency_ci95") for m in mets[i]] for i in impls}
  _bar_groups(ax, labels, series, "E (higher is better), 95% bars",
              intervals=spans)
  ax.axhline(FLAGS.target, color="red", linestyle="--", linewidth=1,
             label=f"target {FLAGS.target}")
  ax.axhline(0.0, color="black", linewidth=0.5)
  ax.legend(fontsize=7)
  ax.set_title(_title(doc, "E = (T_gemm + T_comm - T_fused) / min"),
               fontsize=8)
  written.append(_save(fig, out_dir / f"{stem}_efficiency.png"))

  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels) + 3), 4.5))
  series = {f"T_{b}": [_median(shapes[s].get(b, {})) for s in labels]
            for b in BASELINES}
  for i in impls:
    series[f"T_{i}"] = [_median(shapes[s].get(i, {})) for s in labels]
  ideal = []
  for s in labels:
    g, c = _median(shapes[s].get("gemm", {})), _median(shapes[s].get("comm", {}))
    ideal.append(max(g, c) if g is not None and c is not None else None)
  series["ideal max(T_gemm, T_comm)"] = ideal
  _bar_groups(ax, labels, series, "median time, us (lower is better)")
  ax.set_yscale("log")
  ax.set_title(_title(doc, "time breakdown"), fontsize=8)
  written.append(_save(fig, out_dir / f"{stem}_times.png"))
  return written


def plot_single_gpu(doc, stem: str, out_dir: Path) -> list[Path]:
  """D = 1 fused/XLA ratio per shape; loopback times per shape."""
  shapes = _by_shape(doc["records"])
  written = []
  local = [s for s, recs in shapes.items() if "local_xla" in recs]
  if local:
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(local) + 3), 4.5))
    ratios = [(shapes[s].get("local_fused", {}).get("metrics") or {}).get(
        "fused_over_xla") for s in local]
    _bar_groups(ax, local, {"T_fused / T_xla (D = 1)": ratios},
                "fused time / XLA time (lower is better; < 1: fused faster)")
    ax.axhline(1.0, color="red", linestyle="--", linewidth=1)
    ax.set_title(_title(doc, "D = 1 GEMM: fused kernel / XLA dot"), fontsize=8)
    written.append(_save(fig, out_dir / f"{stem}_local_ratio.png"))
  loop = [s for s, recs in shapes.items() if "loopback_reference" in recs]
  if loop:
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(loop) + 3), 4.5))
    series = {i: [_median(shapes[s].get(i, {})) for s in loop]
              for i in ("loopback_gemm", "loopback_reference", "loopback_fused")}
    _bar_groups(ax, loop, series, "median time, us (lower is better)")
    ax.set_yscale("log")
    ax.set_title(_title(doc, "loopback (D virtual ranks on one GPU)"),
                 fontsize=8)
    written.append(_save(fig, out_dir / f"{stem}_loopback.png"))
  return written


def plot_model_bench(doc, stem: str, out_dir: Path) -> list[Path]:
  """The block end to end: speedup over XLA and exposed communication per (M, pass)."""
  groups: dict[str, dict[str, dict]] = {}
  for r in doc["records"]:
    if r.get("metrics"):
      groups.setdefault(f"M={r['shape']['m']} {r['pass']}", {})[r["implementation"]] = r
  labels = list(groups)
  impls = sorted({i for recs in groups.values() for i in recs})

  def series(key, scale=1.0):
    """{implementation: [metrics[key] * scale per (M, pass), None where absent]}."""
    out = {}
    for i in impls:
      values = [groups[g][i]["metrics"].get(key) if i in groups[g] else None for g in labels]
      out[i] = [None if v is None else v * scale for v in values]
    return out

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(labels) + 3), 7))
  speedups = series("speedup_vs_xla")
  _bar_groups(top, labels, speedups, "T(xla) / T(impl) (higher is better)")
  top.axhline(1.0, color="red", linestyle="--", linewidth=1)
  known = [v for values in speedups.values() for v in values if v is not None]
  if known:
    top.set_ylim(min(known) - 0.05, max(known) + 0.05)
  model = doc["records"][0]["shape"].get("model", "") if doc["records"] else ""
  labelled = {**doc, "mode": doc.get("flags", {}).get("mode"),
              "timer": doc["records"][0].get("timer") if doc["records"] else None,
              "performance_claims": all(r.get("performance_claims") for r in doc["records"])}
  top.set_title(_title(labelled, f"{model} TP block vs XLA"), fontsize=8)
  _bar_groups(bottom, labels, series("exposed_comm_share", 100.0),
              "exposed communication, % of step")
  for ax in (top, bottom):
    ax.set_xlabel("tokens M, pass", fontsize=8)
  written = [_save(fig, out_dir / f"{stem}_block.png")]
  by_layer = {g: groups[g]["xla"]["metrics"]["exposed_comm_by_layer_us"] for g in labels
              if "exposed_comm_by_layer_us" in groups[g].get("xla", {}).get("metrics", {})}
  if by_layer:
    layers = list(next(iter(by_layer.values())))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(by_layer) + 3), 4.5))
    _bar_groups(ax, list(by_layer), {layer: [by_layer[g].get(layer) for g in by_layer]
                                     for layer in layers},
                "T(xla) - T(xla without its collectives), us")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("tokens M, pass", fontsize=8)
    ax.set_title(_title(labelled, f"{model} XLA block by projection"), fontsize=8)
    written.append(_save(fig, out_dir / f"{stem}_layers.png"))
  return written


def not_harness_results(doc) -> str | None:
  """None if `doc` is a matmul_rs_bench results file (what this script plots), else why not."""
  if not isinstance(doc, dict):
    return f"a JSON {type(doc).__name__}, not an object"
  if doc.get("mode") not in RESOLVED_MODES or not isinstance(doc.get("records"), list):
    return f"no harness 'mode' and 'records' (top-level keys: {', '.join(list(doc)[:6])})"
  for r in doc["records"]:
    if not (isinstance(r, dict) and isinstance(r.get("shape"), dict)
            and "name" in r["shape"] and "implementation" in r):
      return "a record without shape.name and implementation"
  return None


def why_not_plotted(doc) -> str | None:
  """None if this script plots `doc` (a harness or model_bench results file), else why not."""
  if isinstance(doc, dict) and doc.get("benchmark") == "model_bench":
    return None if isinstance(doc.get("records"), list) else "model_bench without records"
  return not_harness_results(doc)


def plot_file(path: Path, out_dir: Path) -> list[Path]:
  """The PNGs of one harness results file; [] (with a printed line) for any other JSON."""
  try:
    doc = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    print(f"skip {path}: not readable as JSON ({type(e).__name__}: {e})")
    return []
  why = why_not_plotted(doc)
  if why is not None:
    print(f"skip {path}: not a matmul_rs_bench or model_bench results file ({why})")
    return []
  if doc.get("benchmark") == "model_bench":
    return plot_model_bench(doc, path.stem, out_dir)
  if doc.get("mode") == "single_gpu":
    return plot_single_gpu(doc, path.stem, out_dir)
  return plot_sharded(doc, path.stem, out_dir)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  paths = sorted(glob.glob(FLAGS.results))
  if not paths:
    raise app.UsageError(f"no results match --results={FLAGS.results!r}")
  out_dir = Path(FLAGS.out_dir)
  os.makedirs(out_dir, exist_ok=True)
  plotted = 0
  for p in paths:
    written_files = plot_file(Path(p), out_dir)
    plotted += bool(written_files)
    for written in written_files:
      logging.info("wrote %s", written)
      print(f"wrote {written}")
  print(f"plotted {plotted} of {len(paths)} file(s) into {out_dir}")


if __name__ == "__main__":
  app.run(main)
