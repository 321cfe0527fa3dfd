"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3 and Qwen3-MoE causal LMs.

A checkpoint directory holds `config.json`, the weights (`model.safetensors`, or shards
listed by `model.safetensors.index.json`) and usually `tokenizer.json` +
`tokenizer_config.json` (with a chat template for chat models). Import maps them onto
`tpu_jobs.model.transformer.Transformer`; export writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads. This module is the job (runs in,
runs out); the conversion library it uses is `tpu_jobs.model.hf_checkpoint`.

    python -m tpu_jobs.hf import PATH [--adapter DIR] --run RUN [--config FILE] [key=value ...]
    python -m tpu_jobs.hf export --run RUN --version V|latest --out DIR [--base] [--dtype D]
                                 [--adapter-only]
    python -m tpu_jobs.hf config PATH      # the model.* overrides matching a checkpoint

`import` publishes the weights as version 0 of the run's `base/` parameter server (where the
trainer starts from, like the SFT bootstrap) and copies config/tokenizer files to
`base/hf/`. A run that does not exist yet is created (config file + overrides, with the
model section taken from the checkpoint, and `model.tokenizer=hf` when the checkpoint has
a tokenizer.json: every role then encodes with it, `run_tokenizer`) together with its data,
like `rlax init`; an existing run must have the checkpoint's architecture. `export` writes version V of the
run's trained weights (or of its base with `--base`) with the original config's extra
fields (token ids, max positions) and tokenizer files when the base came from an import.

LoRA runs (`lora.rank > 0`, `pipeline.lora`) interchange adapters in PEFT's format
(`tpu_jobs.model.peft_adapter`). `import --adapter DIR` also publishes a PEFT adapter as
the run's starting adapters (`pipeline.run.start_adapter_server`), refused unless its r,
lora_alpha and target_modules are the run's lora section and its shapes fit the base.
`export` of a LoRA version writes both forms a user wants: DIR is the merged model (base +
scale * A @ B, for plain transformers and vLLM) and DIR/adapter the PEFT adapter (for
`PeftModel.from_pretrained` on the base, which `export --base` writes); `--adapter-only`
skips the merged model.

Nothing here downloads: PATH is a local directory (e.g. a `huggingface-cli download` dir);
bfloat16 checkpoints need neither torch nor network (`tpu_jobs.model.hf_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.layout import HF_PREFIX
from pipeline.lora import merge, split_adapters
from pipeline.tokenizer.hf import CONFIG_FILE, TOKENIZER_FILES, HFError
from tpu_jobs.model.hf_checkpoint import (
    ARCH_FIELDS,
    arch_diff,
    export_hf,
    family_of,
    hf_to_flat,
    load_hf_tensors,
    model_config_from_hf,
    model_overrides,
    param_shapes,
    read_hf_config,
)
from tpu_jobs.model.peft_adapter import export_peft, load_peft

ADAPTER_DIR = "adapter"  # where export puts a LoRA version's PEFT adapter, inside --out


def import_to_run(
    path: str | Path,
    run_url: str,
    *,
    config_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    adapter: str | Path | None = None,
    log=print,
) -> dict[str, Any]:
    """Publish the checkpoint at `path` as version 0 of `run_url`'s base parameter server,
    and the PEFT adapter at `adapter` (if given) as the LoRA run's starting adapters.

    Creates the run (config file + overrides, model section from the checkpoint) and its
    data if it does not exist; an existing run must have the checkpoint's architecture,
    and the adapter the run's lora section (both checked before anything is created).
    Idempotent: a base or adapter already published is left as is. Returns a summary dict.
    """
    from pipeline.config import load_config
    from pipeline.problem_sets import write_data
    from pipeline.run import Run, RunError, base_server, start_adapter_server
    from pipeline.storage import open_store

    path = Path(path)
    hf_cfg = read_hf_config(path)
    fam = family_of(hf_cfg)
    hf_model_cfg = model_config_from_hf(hf_cfg)
    existing = open_store(run_url).exists("config.json")
    if existing:
        run = Run.open(run_url)
        if config_path is not None or overrides:
            log(f"[hf] run {run_url} exists: --config and overrides are ignored")
        cfg = run.config
    else:
        model: dict[str, Any] = {f: getattr(hf_model_cfg, f) for f in ARCH_FIELDS}
        model["max_seq_len"] = hf_model_cfg.max_seq_len
        if (path / "tokenizer.json").is_file():  # the roles use it (an override may not)
            model["tokenizer"] = "hf"
        cfg = load_config(config_path, overrides, extra={"model": model})
    diff = arch_diff(cfg.model, hf_model_cfg)
    if diff:  # checked before creating anything
        raise RunError(
            f"run {run_url} {'has' if existing else 'would have'} another architecture than "
            f"{path}: "
            + ", ".join(f"model.{k}={v[0]!r} (checkpoint: {v[1]!r})" for k, v in diff.items())
            + "; import into a new run, or create it with: "
            + " ".join(model_overrides(hf_model_cfg))
        )
    if cfg.model.tokenizer == "hf" and not (path / "tokenizer.json").is_file():
        raise HFError(
            f"{path} has no tokenizer.json, but run {run_url} "
            f"{'has' if existing else 'would have'} model.tokenizer=hf; import a checkpoint "
            "directory with its tokenizer.json (fast tokenizers only), or use "
            "model.tokenizer=char"
        )
    start = None
    if adapter is not None:  # checked against the run's lora section and the base's shapes
        start = load_peft(adapter, cfg.lora, param_shapes(cfg.model))
    created = not existing
    if created:
        run = Run.create(run_url, cfg)
        n_train, n_eval = write_data(run)
        log(f"[hf] created run {run.url}: {n_train} training and {n_eval} held-out problems")
    server = base_server(run)
    summary = {"run": run.url, "architecture": fam.architecture, "created": created}
    if start is not None:
        summary["adapter_published"] = _publish_start_adapter(
            start_adapter_server(run), start, adapter, log
        )
    if 0 in server.versions():
        log(f"[hf] {run.url}/base already has version 0; leaving it as is")
        return {**summary, "published": False}
    flat = hf_to_flat(load_hf_tensors(path), run.config.model)
    hf_store = server.store.child(HF_PREFIX)
    for name in (CONFIG_FILE, *TOKENIZER_FILES):
        if (path / name).is_file():
            hf_store.write_new(name, (path / name).read_bytes())
    n_params = int(sum(a.size for a in flat.values()))
    server.publish(
        0,
        flat,
        epoch=server.acquire_epoch(),
        metadata={
            "source": "hf",
            "path": str(path.resolve()),
            "architecture": fam.architecture,
            "params": n_params,
        },
    )
    log(f"[hf] published {fam.architecture} ({n_params:,} params) as {run.url}/base v0")
    return {**summary, "published": True, "params": n_params}


def _publish_start_adapter(server, adapters: dict, path: str | Path, log) -> bool:
    if 0 in server.versions():
        log("[hf] the run's starting adapter is published already; leaving it as is")
        return False
    n = int(sum(a.size for a in adapters.values()))
    meta = {"source": "peft", "path": str(Path(path).resolve()), "params": n}
    server.publish(0, adapters, epoch=server.acquire_epoch(), metadata=meta)
    log(f"[hf] published the PEFT adapter {path} ({n:,} params) as the starting adapters")
    return True


def export_from_run(
    run_url: str,
    version: int | str,
    out_dir: str | Path,
    *,
    base: bool = False,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    adapter_only: bool = False,
    log=print,
) -> Path:
    """Export version `version` ("latest" or an int) of the run's weights (its base with
    `base=True`) as an HF checkpoint directory, with the imported config/tokenizer files.

    A version with LoRA adapters is written merged into `out_dir` and as a PEFT adapter in
    `out_dir/adapter` (module docstring); `adapter_only` writes the adapter only."""
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run, base_server
    from pipeline.storage import ObjectNotFound

    run = Run.open(run_url)
    server = base_server(run) if base else ParamServer(run.store)
    v = None if str(version) == "latest" else int(version)
    snap = server.pull(v)
    hf_store = base_server(run).store.child(HF_PREFIX)
    extra, base_config = {}, None
    for name in (CONFIG_FILE, *TOKENIZER_FILES):
        try:
            data = hf_store.read(name)
        except ObjectNotFound:
            continue
        if name == CONFIG_FILE:
            base_config = json.loads(data)
        else:
            extra[name] = data
    weights, adapters = split_adapters(snap.tensors)
    if adapter_only and not adapters:
        raise HFError(
            f"{run.url} {'base ' if base else ''}v{snap.version} holds no LoRA adapters; "
            "allowed: --adapter-only for a version of a run with lora.rank > 0"
        )
    if adapters:
        base_snap = base_server(run).pull(0)
        weights = weights or base_snap.tensors  # an adapter-only version: the run's base
        peft_dir = export_peft(
            Path(out_dir) / ADAPTER_DIR,
            run.config.lora,
            adapters,
            base_model_name_or_path=base_snap.metadata.get("path"),
            dtype=dtype,
        )
        log(f"[hf] exported {run.url} v{snap.version}'s LoRA adapters to {peft_dir} (PEFT)")
        if adapter_only:
            return peft_dir
        weights = merge(weights, adapters, run.config.lora.scale)
    out = export_hf(
        out_dir,
        run.config.model,
        weights,
        family=family_of(base_config).architecture if base_config else None,
        base_config=base_config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_files=extra,
    )
    log(f"[hf] exported {run.url} {'base ' if base else ''}v{snap.version} to {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpu_jobs.hf",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_imp = sub.add_parser("import", help="publish a local HF checkpoint as a run's base model")
    p_imp.add_argument("path", help="local checkpoint directory (config.json + safetensors)")
    p_imp.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    p_imp.add_argument("--config", default=None, help="run config YAML, used if the run is new")
    p_imp.add_argument(
        "--adapter", default=None, help="a PEFT LoRA adapter directory: the starting adapters"
    )
    p_imp.add_argument("overrides", nargs="*", help="dotted overrides, used if the run is new")
    p_exp = sub.add_parser("export", help="write a run's weights as an HF checkpoint directory")
    p_exp.add_argument("--run", required=True)
    p_exp.add_argument("--version", default="latest", help="an int or 'latest'")
    p_exp.add_argument("--out", required=True, help="output directory")
    p_exp.add_argument("--base", action="store_true", help="export the base model (base/)")
    p_exp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p_exp.add_argument("--max-shard-mb", type=int, default=0, help="0: one file")
    p_exp.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA version: write only its PEFT adapter (to OUT/adapter), not the merged model",
    )
    p_cfg = sub.add_parser("config", help="print the model.* overrides of a checkpoint")
    p_cfg.add_argument("path")
    # Overrides may follow --run/--config (argparse would not match them to `overrides`).
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if args.command != "import" or "=" not in r or r.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    from pipeline.config import ConfigError
    from pipeline.run import RunError

    try:
        if args.command == "import":
            import_to_run(
                args.path,
                args.run,
                config_path=args.config,
                overrides=args.overrides,
                adapter=args.adapter,
            )
        elif args.command == "export":
            shard = args.max_shard_mb << 20 if args.max_shard_mb > 0 else None
            export_from_run(
                args.run,
                args.version,
                args.out,
                base=args.base,
                dtype=args.dtype,
                max_shard_bytes=shard,
                adapter_only=args.adapter_only,
            )
        else:
            cfg = model_config_from_hf(read_hf_config(args.path))
            overrides = model_overrides(cfg)
            if (Path(args.path) / "tokenizer.json").is_file():  # as import_to_run decides
                overrides.append("model.tokenizer=hf")
            print(" ".join(overrides))
            print(json.dumps({k: v for k, v in asdict(cfg).items()}, indent=2), file=sys.stderr)
    except (HFError, RunError, ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("hf", main))
