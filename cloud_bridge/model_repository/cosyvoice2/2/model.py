"""cosyvoice2, this version: the orchestrator of cloud_bridge/triton/orchestrator.py.
The bundle of this version is the `bundle` link beside this file (made by
`cosyedge triton`), else the BUNDLE_DIR parameter or $COSYEDGE_BUNDLE."""

try:
    from cosyedge_cloud.triton.orchestrator import TritonPythonModel  # noqa: F401
except ImportError as exc:  # pragma: no cover - inside tritonserver only
    raise ImportError(
        "the cosyedge project must be importable by Triton's Python backend "
        "(.ci/setup.d/triton.sh puts it on .venv-triton's path; elsewhere: pip install --no-deps cosyedge); "
        f"the import failed with: {exc!r}"
    ) from exc
