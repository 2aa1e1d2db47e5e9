"""The GPU memory tables of issue 22 from `plait bench memory` JSON written on a GPU:
each run's measured activations (live storages saved for backward) and
torch.cuda.max_memory_allocated against plait's formula as it prices that run now
(``plait.bench.memory.predicted_of`` on the run's device), so a summary measured
before a change to the formula is re-priced by the current one.

    python bench/gpu/memory_table.py bench/gpu/results/run2-memory.json [...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from plait.bench.memory import MemoryBenchConfig, gpt_spec, predicted_of
from plait.train.config import TrainConfig
from plait.train.corpus import load_corpus

MIB = 1 << 20


def corpus_vocab() -> int:
    """The vocabulary `plait bench memory` trained with (plait train's default corpus)."""
    train = TrainConfig()
    return load_corpus(train.data, max_bytes=train.data_max_bytes, val_fraction=train.val_fraction).vocab_size


def rows_of(path: str, vocab: int) -> list[dict]:
    summary = json.loads(open(path).read())
    config = summary["config"]
    fields = {f.name for f in dataclasses.fields(MemoryBenchConfig)}
    config = MemoryBenchConfig(**{k: tuple(tuple(m) for m in v) if k == "meshes" else
                                  (tuple(v) if isinstance(v, list) else v)
                                  for k, v in config.items() if k in fields})
    table = []
    for row in summary["rows"]:
        measured = row["measured"]
        device = measured.get("device", "cuda:0").split(":")[0]
        spec = gpt_spec(config, vocab)
        mesh = (row["dp"], row["tp"], row["pp"])
        now = predicted_of(config, spec, mesh, row["recompute"], row["precision"], row["offload"], device)
        table.append({"file": path, "mesh": mesh, "recompute": row["recompute"], "precision": row["precision"],
                      "offload": row["offload"], "measured_mib": measured["activations_bytes"] / MIB,
                      "predicted_then_mib": row["predicted"]["activations_bytes"] / MIB,
                      "predicted_mib": now["activations_bytes"] / MIB,
                      "max_memory_allocated_mib": measured["resident_peak_bytes"] / MIB,
                      "state_measured_mib": measured["model_state_bytes"] / MIB,
                      "state_predicted_mib": now["model_state_bytes"] / MIB,
                      "step_s": measured["step_s"]})
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+")
    args = parser.parse_args(argv)
    print("| run | recompute | precision | offload | step s | activations measured MiB | plait (before) | "
          "plait (now) | error now | max_memory_allocated MiB | state measured / plait MiB |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    vocab = corpus_vocab()
    for path in args.summaries:
        for r in rows_of(path, vocab):
            error = (r["predicted_mib"] - r["measured_mib"]) / r["measured_mib"] * 100
            print(f"| {path.rsplit('/', 1)[-1]} | {r['recompute']} | {r['precision']} | {'on' if r['offload'] else 'off'} "
                  f"| {r['step_s']:.2f} | {r['measured_mib']:.1f} | {r['predicted_then_mib']:.1f} | "
                  f"{r['predicted_mib']:.1f} | {error:+.1f}% | {r['max_memory_allocated_mib']:.0f} | "
                  f"{r['state_measured_mib']:.1f} / {r['state_predicted_mib']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
