"""`cosyedge model pull|list|remove`: the bundles in the bundles folder
(daemon/cli/bundles.py); `pull` downloads a checkpoint and builds the bundle
with the build side (cosyedge_build.pull)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cosyedge_daemon.cli.bundles import bundles_dir, list_bundles, remove_bundle
from cosyedge_daemon.settings.loader import load_settings
from cosyedge_models.errors import CosyEdgeError


def folder(args: argparse.Namespace) -> Path:
    """--bundles-dir, else the config's [tts] bundles_dir, else the default."""
    if getattr(args, "bundles_dir", None):
        return Path(args.bundles_dir)
    return bundles_dir(load_settings(getattr(args, "config", None)).tts.bundles_dir)


def _in_use(args: argparse.Namespace, path: Path) -> bool:
    configured = load_settings(getattr(args, "config", None)).tts.bundle
    return bool(configured) and Path(configured).expanduser().resolve() == path.resolve()


def model_command(args: argparse.Namespace) -> int:
    root = folder(args)
    if args.model_cmd == "list":
        bundles = list_bundles(root)
        if not bundles:
            print(f"no bundles in {root}; `cosyedge model pull` downloads and builds one")
            return 0
        for b in bundles:
            print(b.line())
        return 0
    if args.model_cmd == "remove":
        if _in_use(args, root / args.name) and not args.force:
            raise CosyEdgeError(f"{root / args.name} is the configured [tts] bundle; change the config first, "
                                "or pass --force")
        removed = remove_bundle(root, args.name)
        print(f"removed {removed}")
        return 0
    if args.model_cmd == "pull":
        from cosyedge_daemon.cli.model_pull import pull_command

        return pull_command(args, root)
    raise CosyEdgeError(f"unknown model command '{args.model_cmd}'; expected pull, list or remove")
