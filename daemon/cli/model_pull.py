"""`cosyedge model pull [NAME]`: the checkpoint from its hub, the bundle built
for this machine (cosyedge_build.pull), installed in the bundles folder; then
the config lines that use it (or --set-default writes them)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from cosyedge_daemon.cli.bundles import bundle_name, install_bundle
from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)


def _machine() -> tuple[bool, bool]:
    """(TensorRT usable, onnxruntime's CUDA provider usable) on this machine."""
    from cosyedge_models.backends.gpu_probe import probe_gpu, probe_tensorrt

    if not probe_gpu().available:
        return False, False
    import onnxruntime

    return probe_tensorrt().available, "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def pull_command(args: argparse.Namespace, root: Path) -> int:
    try:
        from cosyedge_build.pull.hub import resolve_repo
        from cosyedge_build.pull.pipeline import PullJob, backend_for, choose_precision, run_pull
    except ImportError as exc:  # the build extra (torch) is not installed
        from cosyedge_models.errors import MissingExtraError

        if str(getattr(exc, "name", "")).startswith("cosyedge"):
            raise
        raise MissingExtraError(str(getattr(exc, "name", "torch")), "build", "cosyedge model pull") from exc
    # the whole build side is needed, not only the download: say so before gigabytes arrive
    for module in ("huggingface_hub", "torch", "transformers", "onnx", "hyperpyyaml"):
        if importlib.util.find_spec(module) is None:
            from cosyedge_models.errors import MissingExtraError

            raise MissingExtraError(module, "build", "cosyedge model pull (the download and the export)")
    if args.set_default and not args.config:
        raise CosyEdgeError("--set-default writes the config file given with --config FILE")
    repo, model = resolve_repo(args.name, args.source)
    revision = args.revision or ("master" if args.source == "modelscope" else "main")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise CosyEdgeError(f"cannot write to the bundles folder {root} ({exc.strerror}): run the pull as its owner "
                            "(sudo -u cosyedge cosyedge model pull ...) or pass --bundles-dir DIR") from exc
    tensorrt, cuda = _machine()
    precision = choose_precision(args.precision, tensorrt, cuda)
    engines = tensorrt and precision != "int8w" if args.engines is None else args.engines
    if engines and not tensorrt:
        raise CosyEdgeError("--engines needs TensorRT on this machine (`cosyedge doctor` says what is missing)")
    if engines and precision == "int8w":
        raise CosyEdgeError("int8w (weight-only) is an onnxruntime format: TensorRT engines are built from fp32, "
                            "fp16 or int8; pass --no-engines or another --precision")
    name = bundle_name(model, precision)
    work = root / f".pull-{bundle_name(model, 'work')}"
    print(f"pulling {repo}@{revision} from {args.source} into {root / name} ({precision}"
          f"{', TensorRT engines' if engines else ''})", flush=True)
    job = PullJob(repo=repo, revision=revision, source=args.source, precision=precision, engines=engines,
                  work=work, endpoint=args.endpoint, check_resources=not args.skip_resource_check)
    result = run_pull(job)
    installed = install_bundle(root, name, result.bundle, result.record)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    backend = backend_for(precision, bool(result.record["engines"]), cuda)
    values = {"bundle": str(installed), "backend": backend}
    if args.set_default:
        from cosyedge_daemon.cli.config_edit import write_config

        write_config(Path(args.config), "tts", values)
        print(f"installed {installed}; {args.config} now uses it ([tts] bundle, backend = \"{backend}\"); "
              "reload the daemon (systemctl reload cosyedge, or SIGHUP)")
    else:
        print(f"installed {installed}. To use it, put in the config file ([tts] section):")
        print("\n".join(f'{k} = "{v}"' for k, v in values.items()))
        print(f"or run: cosyedge run --bundle {installed}" + (f" (with [tts] backend = \"{backend}\")"
                                                             if backend != "ort" else ""))
    return 0
