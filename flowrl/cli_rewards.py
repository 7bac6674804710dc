"""`flowrl rewards list`, `flowrl score` and `flowrl serve-reward`: the arguments and work of the reward subcommands
(flowrl/cli.py registers them). Heavy imports happen inside the `_run_*` functions, as in flowrl/cli.py."""

from __future__ import annotations

import argparse
import sys


def _parse_sets(pairs: list[str] | None) -> dict:
    """`--set key=value` pairs -> kwargs; values are JSON when they parse (numbers, true, null, lists), else strings."""
    import json

    kwargs = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {pair!r} is not key=value; write e.g. --set checkpoint=/path/model.pt")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    return kwargs


def _build_reward(name: str, pairs: list[str] | None, device: str | None, dtype: str, settings: dict | None = None):
    """The reward `name` built with `--set` pairs (checked by check_settings), or with checked `settings`."""
    import torch

    from flowrl.registry import REWARDS
    from flowrl.reward_contract import check_settings

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = check_settings(name, _parse_sets(pairs)) if settings is None else settings
    return REWARDS.get(name)(device=device, dtype=getattr(torch, dtype), **settings)


def _add_rewards(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rewards", help="list the registered rewards")
    p.add_argument("action", choices=["list"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_rewards(args: argparse.Namespace) -> int:
    import json

    from flowrl.environment import installed
    from flowrl.registry import REWARDS

    rows = []
    for name in REWARDS.names():
        cls = REWARDS.get(name)
        extras = list(getattr(cls, "extra_requires", ()))  # a plugin that declares none
        rows.append(
            {
                "name": name,
                "modalities": list(cls.modalities),
                "differentiable": bool(cls.differentiable),
                "extra_requires": extras,
                "installed": all(installed(e) for e in extras),
                "missing": [e for e in extras if not installed(e)],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<24} {'modalities':<12} {'diff':<5} {'extras':<28} installed")
    for r in rows:
        extras = ",".join(r["extra_requires"]) or "-"
        state = "yes" if r["installed"] else "no (missing " + ",".join(r["missing"]) + ")"
        modalities, differentiable = ",".join(r["modalities"]), "yes" if r["differentiable"] else "no"
        print(f"{r['name']:<24} {modalities:<12} {differentiable:<5} {extras:<28} {state}")
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score", help="score image or video files with one reward (check a reward before training on it)"
    )
    p.add_argument("--reward", required=True, help="registered name or dotted path")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="reward config, e.g. --set checkpoint=/path")
    p.add_argument(
        "--prompt", action="append", required=True, help="one prompt for all files, or one per file (repeat)"
    )
    p.add_argument("files", nargs="+", help="PNG/JPEG images; GIF/MP4 or folders of frames for video rewards")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _run_score(args: argparse.Namespace) -> int:
    import json
    import os

    import torch

    from flowrl import media
    from flowrl.registry import REWARDS
    from flowrl.reward_contract import nan_to_none, score_checked

    prompts = args.prompt * len(args.files) if len(args.prompt) == 1 else args.prompt
    if len(prompts) != len(args.files):
        raise ValueError(
            f"--prompt given {len(args.prompt)} times for {len(args.files)} files; give one prompt, or one per file"
        )
    # the files are read before the reward loads its weights, so a bad file fails at once
    modalities = REWARDS.get(args.reward).modalities
    video = "image" not in modalities or all(
        f.lower().endswith(media.VIDEO_SUFFIXES) or os.path.isdir(f) for f in args.files
    )
    if video and "video" not in modalities:
        raise ValueError(
            f"file {args.files[0]!r} is a video or a folder of frames, but reward {args.reward!r} scores "
            f"{', '.join(modalities)} only; pass image files"
        )
    images = media.load_videos(args.files) if video else media.load_images(args.files)
    reward = _build_reward(args.reward, args.set, args.device, args.dtype)
    try:
        with torch.no_grad():
            out = score_checked(reward, images, prompts, [{} for _ in prompts])
    except (
        RuntimeError,
        ConnectionError,
    ) as err:  # a failing reward, named with the sample index; an unreachable remote
        print(f"flowrl score: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    scores = nan_to_none(out.scores.cpu().tolist())
    if args.json:
        parts = {k: nan_to_none(v.float().cpu().tolist()) for k, v in out.parts.items()}
        rows = [
            {"file": f, "score": s, **{k: v[i] for k, v in parts.items()}}
            for i, (f, s) in enumerate(zip(args.files, scores))
        ]
        print(json.dumps(rows, indent=2))
    else:
        for f, s in zip(args.files, scores):
            print(f"{'n/a' if s is None else f'{s:.6g}'}\t{f}")
    return 0


def _add_serve_reward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-reward",
        help="serve registered rewards over HTTP for the `remote` reward "
        "(Ray Serve replicas with batching across requests)",
    )
    p.add_argument("name", nargs="?", help="the reward to serve (registered name or dotted path)")
    p.add_argument("--reward", action="append", default=[], metavar="NAME", help="serve this reward too (repeatable)")
    p.add_argument(
        "--set",
        action="append",
        metavar="[NAME:]KEY=VALUE",
        help="reward config, e.g. --set checkpoint=/path; "
        "NAME: prefixes a setting of one reward when several are served",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: localhost only; any other needs --token)"
    )
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed at start)")
    p.add_argument("--token", default=None, help="require `Authorization: Bearer TOKEN` on every request")
    p.add_argument(
        "--engine",
        default="ray",
        choices=["ray", "local"],
        help="ray: Ray Serve replicas (flowrl[serve]); local: this process, one request at a time",
    )
    p.add_argument("--replicas", type=int, default=1, help="replicas per reward (ray)")
    p.add_argument(
        "--gpus-per-replica", type=float, default=None, help="GPUs per replica (ray; default 1 where CUDA is, else 0)"
    )
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs per replica (ray; fractions share a core)")
    p.add_argument("--max-batch-size", type=int, default=16, help="images per forward, gathered across requests (ray)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="longest wait for a batch to fill (ray)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="a request body over this is answered 413 unread")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a request's header, and then its body, may take to arrive "
        "(else 408; an idle connection is closed)",
    )
    p.add_argument(
        "--max-connections", type=int, default=128, help="connections served at once, a thread each; more get 503"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _serve_settings(names: list[str], pairs: list[str] | None) -> dict[str, dict]:
    """{reward: its checked settings}; `NAME:KEY=VALUE` goes to NAME only, `KEY=VALUE` to every reward."""
    from flowrl.reward_contract import check_settings

    for pair in pairs or []:
        prefix = pair.split("=", 1)[0].split(":", 1)
        if len(prefix) == 2 and prefix[0] not in names:
            raise ValueError(f"--set {pair}: {prefix[0]!r} is not a served reward; serve it with --reward {prefix[0]}")
    own = lambda name, pair: pair.split(":", 1)[1] if pair.startswith(f"{name}:") else pair  # noqa: E731
    mine = lambda name, pair: pair.startswith(f"{name}:") or ":" not in pair.split("=", 1)[0]  # noqa: E731
    return {
        name: check_settings(name, _parse_sets([own(name, p) for p in pairs or [] if mine(name, p)])) for name in names
    }


def _run_serve_reward(args: argparse.Namespace) -> int:
    import signal

    import torch

    from flowrl.serving.server import LOOPBACK, LocalBackend, check_limits, make_server

    names = list(dict.fromkeys(([args.name] if args.name else []) + args.reward))
    if not names:
        raise ValueError("serve-reward: name a reward, e.g. `flowrl serve-reward pickscore` (more with --reward NAME)")
    if args.host not in LOOPBACK and not args.token:
        raise ValueError(
            f"--host {args.host} is reachable from other machines; pass --token TOKEN (or bind to 127.0.0.1)"
        )
    check_limits(args.request_timeout, args.max_connections)  # before any reward or replica is built
    settings = _serve_settings(names, args.set)
    if args.engine == "local":
        backend = LocalBackend({n: _build_reward(n, None, args.device, args.dtype, settings[n]) for n in names})
    else:
        try:
            from flowrl.serving.ray_serve import RayBackend
        except ImportError:
            raise ValueError(
                "--engine ray needs Ray Serve: pip install 'flowrl[serve]' (or pass --engine local)"
            ) from None
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(torch.cuda.is_available())
        try:
            backend = RayBackend(
                settings,
                device=args.device,
                dtype=args.dtype,
                replicas=args.replicas,
                gpus_per_replica=gpus,
                cpus_per_replica=args.cpus_per_replica,
                max_batch_size=args.max_batch_size,
                batch_wait_ms=args.batch_wait_ms,
            )
        except RuntimeError as err:  # a replica failed to build its reward: its one-line cause, Ray already stopped
            print(f"flowrl serve-reward: error: {err}", file=sys.stderr)
            return 1
    try:
        limits = {"request_timeout": args.request_timeout, "max_connections": args.max_connections}
        server = make_server(
            backend, args.host, args.port, args.token, max_body_bytes=int(args.max_body_mb * 2**20), **limits
        )
    except BaseException:
        backend.close()
        raise

    def stop(signum, frame):  # SIGTERM: leave serve_forever, then close the server and its backend (Ray stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    host, port = server.server_address[:2]
    print(f"flowrl serve-reward: serving {', '.join(names)} on http://{host}:{port}", flush=True)
    if getattr(backend, "address", None):  # `ray status --address ...` and ray.init(address=...) reach its replicas
        print(f"flowrl serve-reward: Ray at {backend.address}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
