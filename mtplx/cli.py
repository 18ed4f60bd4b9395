"""The `mtplx` command line. Heavy modules (MLX, the engine, Textual) load inside commands, so
`mtplx --help` stays fast and never imports MLX."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from mtplx.errors import MtplxError

app = typer.Typer(help="mtplx: run and inspect LLM sessions on MLX (MTP speculation, session bank, receipts).",
                  no_args_is_help=True, add_completion=False)

MODEL_HELP = ("An embedded model name (tiny-dense, tiny-hybrid), a local model directory, or a hub id (org/name) "
              "already in the local Hugging Face cache.")


BANK_RAM_HELP = "RAM budget of the session bank (e.g. 2GiB, 512M); default: a quarter of free memory."
BANK_SSD_HELP = "Disk budget of the bank's SSD tier (e.g. 20GB); default: a tenth of the free disk, at most 20 GiB."


def _budgets(bank_ram: str | None, bank_ssd: str | None) -> dict:
    from mtplx.byte_size import parse_size

    return {"bank_ram": parse_size(bank_ram, "--bank-ram") if bank_ram else None,
            "bank_ssd": parse_size(bank_ssd, "--bank-ssd") if bank_ssd else None}


def _listen(host: str, port: int):
    from mtplx.server.listener import bind

    return bind(host, port)


NO_TEMPLATE = ("this model has no chat template (a base model?): /v1/completions serves it; the chat routes "
               "answer 400 until its directory has a chat_template.jinja")


def _fail(exc: Exception) -> None:
    typer.secho(f"error: {exc}", fg="red", err=True)
    raise typer.Exit(2)


@app.command()
def models(
    path: Optional[str] = typer.Argument(None, help="Also describe this model directory or cached hub id (org/name)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (with each model's directory path)."),
) -> None:
    """List the embedded models, the runnable models in the local Hugging Face cache (and PATH):
    architecture, parameters, MTP, template features."""
    from mtplx.catalog import EMBEDDED, cached, describe, resolve

    try:
        rows = [describe(resolve(name), name) for name in EMBEDDED] + cached()
        if path is not None:
            rows.append(describe(resolve(path)))
    except MtplxError as exc:
        _fail(exc)
    from mtplx.fast_path import predicted, quantized_here

    compute = predicted()  # what a model loaded here runs on (no MLX import: see mtplx/fast_path.py)
    for r in rows:
        r["window"] = _window_line(r)
        # a quantized model's weights as it will run here (unpacked to fp32, or kept packed)
        r["weights_here"] = quantized_here(r.get("quantization"), (r["parameters"] + r["mtp_parameters"]) * 4)
    if as_json:
        typer.echo(json.dumps([{**r, "compute": compute} for r in rows], indent=2))
        return
    typer.echo(f"compute here: {compute}")
    for r in rows:
        t = r["template"]
        features = ", ".join(k for k in ("tools", "thinking", "enable_thinking") if t[k]) or "none"
        if t.get("calls"):  # a template that drops `tools` gets them described in the system prompt (tool_prompt.py)
            features += f"; calls: {t['calls']}" + ("" if t["tools"] else " (tools described by mtplx)")
        typer.echo(f"{r['name']:<14} {r['architecture']:<9} {r['parameters'] / 1e6:5.2f}M params  "
                   f"layers {r['layers']} ({r['recurrent_layers']} recurrent)  "
                   f"MTP {'yes' if r['mtp'] else 'no'}  template: {features}\n{'':<14} {r['path']}"
                   + (f"\n{'':<14} {r['mtp_notice']}" if r.get("mtp_notice") else "")
                   + (f"\n{'':<14} {r['weights_here']}" if r.get("weights_here") else "")
                   + f"\n{'':<14} {r['window']}")


def _mtp_notice(engine) -> None:
    """One line when the model will not speculate, and why (no head, an unsupported family); one
    when it has no chat template (a base model), so the chat routes' 400s are no surprise."""
    notice = engine.checkpoint.mtp_notice
    if notice:
        typer.secho(f"notice: {notice}", fg="yellow", err=True)
    from mtplx import chat_template

    if not chat_template.present(engine.checkpoint.tokenizer):
        typer.secho(f"notice: {NO_TEMPLATE}", fg="yellow", err=True)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The user message (rendered with the chat template)."),
    model: str = typer.Option("tiny-dense", "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", min=0.0,
                                                help="Default: the model's generation_config.json, else 0 (greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, max=4, help="MTP draft depth (default: tuned or 2)."),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Decode autoregressively."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as-is, without the chat template."),
    no_think: bool = typer.Option(False, "--no-think", help="Render with enable_thinking=false."),
) -> None:
    """Stream a completion from the command line, then print speed and acceptance to stderr."""
    from mtplx.launch import open_engine

    try:
        engine = open_engine(model, depth=depth, no_mtp=no_mtp)
    except MtplxError as exc:
        _fail(exc)
    _mtp_notice(engine)
    from dataclasses import replace

    from mtplx.chat import chat_request
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams
    from mtplx.events import Failed, Finished, Tokens

    tok = engine.checkpoint.tokenizer
    params = engine.checkpoint.generation.defaults(SamplingParams(seed=seed, max_tokens=max_tokens))
    params = params if temperature is None else replace(params, temperature=temperature)
    if raw:
        request = GenerationRequest(tuple(tok.encode(prompt)), params, source="cli")
    else:
        request = chat_request(tok, [{"role": "user", "content": prompt}], sampling=params,
                               enable_thinking=not no_think, source="cli")
    for event in engine.submit(request):
        if isinstance(event, Tokens):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Failed):
            _fail(MtplxError(event.message))
        elif isinstance(event, Finished):
            s = event.stats
            acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in s.acceptance_by_depth)
            typer.echo(f"\n[{s.mode}{' depth ' + str(s.depth) if s.depth else ''}] "
                       f"{event.completion_tokens} tokens, {s.decode_tps or 0:.1f} tok/s, TTFT {s.ttft_s:.3f}s"
                       + (f", tau {s.tau:.2f}, acceptance by depth {acc}" if s.tau else "")
                       + f", finish {event.finish_reason}", err=True)
    engine.stop()


@app.command()
def tune(
    model: str = typer.Option("tiny-dense", "--model", "-m", help=MODEL_HELP),
    tokens: int = typer.Option(128, "--tokens", help="Tokens generated per measurement."),
    save: bool = typer.Option(True, "--save/--no-save", help="Store the fastest setting as this model's default."),
) -> None:
    """Measure AR and each MTP depth on this machine; store the fastest as the default."""
    from mtplx.tuning import tune_model

    try:
        tune_model(model, tokens=tokens, save=save, echo=typer.echo)
    except MtplxError as exc:
        _fail(exc)


def _window_line(row: dict) -> str:
    from mtplx.server.context import trained_window

    trained = trained_window(Path(row["path"]))
    row["trained_window"] = trained
    return (f"context: {row.get('context_window') or '?'} positions"
            + (f", trained on {trained}-token windows (serve --context-window N allows more, with degraded quality)"
               if trained else ""))


def _window_notice(engine) -> None:
    from mtplx.server.context import window_notice

    notice = window_notice(engine)
    if notice:
        typer.secho(f"notice: {notice}", fg="yellow", err=True)


TUI_PORT = 8080  # the endpoint beside the workbench, unless taken (then any free port, said on screen)


@app.command()
def tui(
    model: str = typer.Option("tiny-dense", "--model", "-m", help=MODEL_HELP),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, max=4, help="MTP draft depth (default: tuned or 2)."),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Decode autoregressively."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    port: Optional[int] = typer.Option(None, "--port", min=0, max=65535, help="Port of the endpoint served "
                                       "alongside (127.0.0.1; default 8080, or a free one when 8080 is taken); 0 "
                                       "picks a free one (shown in the header)."),
    no_serve: bool = typer.Option(False, "--no-serve", help="Do not serve the endpoint."),
    no_ssd: bool = typer.Option(False, "--no-ssd", help="Keep the session bank in RAM only."),
    bank_ram: Optional[str] = typer.Option(None, "--bank-ram", help=BANK_RAM_HELP),
    bank_ssd: Optional[str] = typer.Option(None, "--bank-ssd", help=BANK_SSD_HELP),
    attach: Optional[str] = typer.Option(None, "--attach", help="Follow a running `mtplx serve` at this URL instead "
                                         "(http://host:port, with or without /v1)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MTPLX_API_KEY",
                                          help="With --attach: the server's API key (sent as a bearer token)."),
    context_window: Optional[int] = typer.Option(None, "--context-window", min=256, help="Tokens of context (prompt + "
                                                 "reply) to allow; default: the model's max_position_embeddings."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", min=1, max=64, help="Requests decoding together "
                                            "(one batched forward per step; default 8, 1 = one at a time)."),
    prefill_share: Optional[float] = typer.Option(None, "--prefill-share", min=0.05, max=1.0, help="While prompts "
                                                  "are computed beside streaming replies, the share of the engine's "
                                                  "time the prompts get (default 0.5; 1 = a prompt chunk every step)."),
    replay: Optional[Path] = typer.Option(None, "--replay", exists=True, dir_okay=False,
                                          help="Open the replay screen on this transcript (the `mtplx replay` format)."),
) -> None:
    """The workbench: chat, watch restores, anchors and acceptance live, replay transcripts, browse receipts."""
    from tui.app import MtplxApp

    if attach:
        from tui.attach import normalise

        MtplxApp(None, normalise(attach), attach_url=normalise(attach), api_key=api_key).run()
        return
    from mtplx.launch import open_engine

    moved = None
    try:
        if no_serve:
            sock = None
        elif port is None:  # the default: a first run must not fail because 8080 is some other server's
            try:
                sock = _listen("127.0.0.1", TUI_PORT)
            except MtplxError as exc:
                sock = _listen("127.0.0.1", 0)
                from mtplx.server.listener import url_of

                moved = f"{exc}. The endpoint serves on {url_of(sock)}/v1 instead."
        else:
            sock = _listen("127.0.0.1", port)  # a port asked for by name: busy fails before the model loads
        engine = open_engine(model, depth=depth, no_mtp=no_mtp, ssd=not no_ssd, context_window=context_window,
                             max_batch=max_batch, prefill_share=prefill_share, **_budgets(bank_ram, bank_ssd))
    except MtplxError as exc:
        _fail(exc)
    _window_notice(engine)
    server = None
    try:
        if sock is not None:
            from mtplx.server.app import create_app
            from mtplx.server.background import BackgroundServer

            server = BackgroundServer(create_app(engine, model), sock=sock).start()
        workbench = MtplxApp(engine, model, max_tokens, server.url if server else None, replay_file=replay,
                             notice=moved)
        workbench.freeze_when_drawn = True  # the dashboard's widgets join the long-lived heap (mtplx/long_lived.py)
        import signal

        # SIGTERM (a closed tmux pane, a service manager) quits like ctrl+q, so the bank is flushed.
        signal.signal(signal.SIGTERM, lambda sig, frame: workbench.call_later(workbench.action_quit))
        workbench.run()
    finally:
        if server is not None:
            server.stop()
        engine.stop()


@app.command()
def serve(
    model: str = typer.Option("tiny-dense", "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="0 picks a free port (printed)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MTPLX_API_KEY", help="Required unless bound to loopback."),
    cors_origin: Optional[List[str]] = typer.Option(None, "--cors-origin", metavar="ORIGIN", help="A web origin (https://app.example) "
                                                    "whose pages may call the endpoint from a browser, besides this "
                                                    "machine's (localhost, any port); repeatable; * for any."),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, max=4, help="MTP draft depth (default: tuned or 2)."),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Decode autoregressively."),
    no_ssd: bool = typer.Option(False, "--no-ssd", help="Keep the session bank in RAM only."),
    bank_ram: Optional[str] = typer.Option(None, "--bank-ram", help=BANK_RAM_HELP),
    bank_ssd: Optional[str] = typer.Option(None, "--bank-ssd", help=BANK_SSD_HELP),
    context_window: Optional[int] = typer.Option(None, "--context-window", min=256, help="Tokens of context (prompt + "
                                                 "reply) to allow; default: the model's max_position_embeddings."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", min=1, max=64, help="Requests decoding together "
                                            "(one batched forward per step; default 8, 1 = one at a time)."),
    prefill_share: Optional[float] = typer.Option(None, "--prefill-share", min=0.05, max=1.0, help="While prompts "
                                                  "are computed beside streaming replies, the share of the engine's "
                                                  "time the prompts get (default 0.5; 1 = a prompt chunk every step)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="Shard the model over ranks: tp (tensor parallel) or pp "
                                        "(pipeline parallel), on MLX's ring backend (docs/scale.md)."),
    ranks: Optional[int] = typer.Option(None, "--ranks", min=2, help="With --shard: start this many ranks on this "
                                        "machine over loopback."),
    hostfile: Optional[Path] = typer.Option(None, "--hostfile", help="With --shard: start one rank per host in this "
                                            "mlx.launch hostfile (ssh to each; several machines)."),
    split: Optional[str] = typer.Option(None, "--split", help="With --shard pp: layers per rank, e.g. 10,14 (rank 0 "
                                        "holds the last layers); default: even."),
    watchdog: float = typer.Option(60.0, "--watchdog", min=1.0, help="With --shard: seconds a collective may wait "
                                   "before every rank exits (a lost or hung peer)."),
) -> None:
    """Serve the OpenAI + Anthropic compatible API (headless). SIGTERM or ctrl+c stops it cleanly:
    in-flight turns end, the bank is flushed to SSD, exit 0."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        _fail(MtplxError(f"binding to {host} exposes the model beyond this machine: pass --api-key"))
    group = _sharding(model, shard, ranks, hostfile, split, watchdog, host, port)
    from mtplx.launch import open_engine
    from mtplx.server.app import create_app, serve_forever

    from mtplx.server.listener import url_of

    try:
        sock = _listen(host, port) if group is None or group.rank == 0 else None  # a busy port fails at once
        engine = open_engine(model, depth=depth, no_mtp=no_mtp, ssd=not no_ssd, context_window=context_window,
                             max_batch=max_batch, prefill_share=prefill_share, receipts=group is None or group.rank == 0,
                             group=group,
                             **_budgets(bank_ram, bank_ssd))
    except MtplxError as exc:
        if group is not None and group.rank != 0:
            raise typer.Exit(2)  # every rank refuses alike; rank 0 says why
        _fail(exc)
    if group is not None and group.rank != 0:  # only rank 0 has clients; this rank follows it until it stops
        raise typer.Exit(engine.follow())
    _window_notice(engine)
    _mtp_notice(engine)
    typer.echo(f"mtplx serving {model} on {url_of(sock)}/v1", err=True)
    try:
        served = create_app(engine, model, api_key, cors_origins=tuple(cors_origin or ()))
        from mtplx import long_lived

        long_lived.freeze()  # engine, tokenizer, routes: never walked by a full collection mid-turn
        received = serve_forever(served, sock, engine.cancel_all)
    finally:
        engine.stop()
    if received:
        typer.echo("mtplx stopped: in-flight turns ended, bank flushed", err=True)


def _sharding(model, shard, ranks, hostfile, split, watchdog, host, port):
    """None for an unsharded serve; this rank's Group when launched as a rank. Started with --ranks
    or --hostfile (and not yet a rank), it starts the ranks, waits for them, and exits with their status."""
    if shard is None:
        if ranks or hostfile or split:
            _fail(MtplxError("--ranks, --hostfile and --split need --shard tp or --shard pp"))
        return None
    if shard not in ("tp", "pp"):
        _fail(MtplxError(f"--shard must be tp or pp, got {shard!r}"))
    from mtplx.distributed import launch as ranks_launch
    from mtplx.distributed.group import join, launched

    if launched():
        try:
            return join(shard, tuple(int(n) for n in split.split(",")) if split else (), watchdog)
        except (MtplxError, ValueError) as exc:
            _fail(exc)
    if ranks is None and hostfile is None:
        _fail(MtplxError("--shard needs --ranks N (ranks on this machine) or --hostfile FILE, or a start under mlx.launch"))
    if ranks is not None:  # what the config alone refuses is refused before any rank starts
        from mtplx.catalog import resolve
        from mtplx.distributed.layout import Layout, check
        from mtplx.engine.checkpoint import read_config

        try:
            check(read_config(resolve(model)), Layout(shard, ranks, 0, tuple(int(n) for n in split.split(",")) if split else ()))
        except (MtplxError, ValueError) as exc:
            _fail(exc)
    _listen(host, port).close()  # a busy port fails here, before any rank loads the model
    argv = ["-m", "mtplx.cli", *sys.argv[1:]]
    code = ranks_launch.run_hostfile(argv, hostfile) if hostfile else ranks_launch.run_local([sys.executable, *argv], ranks)
    raise typer.Exit(code)


@app.command()
def replay(
    target: str = typer.Argument(..., help="A transcript file, or the word 'compare' followed by two receipt files."),
    others: list[str] = typer.Argument(None, help="With 'compare': the two receipt files."),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="Replay against this OpenAI-compatible server "
                                           "instead of an in-process one."),
    model: str = typer.Option("tiny-dense", "--model", "-m", help=MODEL_HELP + " Its tokenizer counts prompts and ceilings."),
    arms: list[str] = typer.Option([], "--arm", help="Run in-process under this setting (bank, no-bank, mtp, no-mtp, "
                                   "render-ahead, no-render-ahead, depth=N; join with +). Give two for an A/B."),
    pairs: int = typer.Option(1, "--pairs", min=1, help="With two arms: balanced pairs (AB, BA, ...)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Receipt file (never overwritten); default under $MTPLX_HOME/replays/."),
    pause: float = typer.Option(0.0, "--pause", min=0.0, help="Seconds to wait between turns, as an agent does while "
                                "its tools run (idle time a server may use; 0 = back to back)."),
) -> None:
    """Replay a frozen transcript's requests in order and write receipts (or compare two receipt files)."""
    from mtplx.replay.session import compare_files, run_replay

    try:
        if target == "compare":
            if len(others or []) != 2:
                _fail(MtplxError("usage: mtplx replay compare A.json B.json"))
            table, parity = compare_files(Path(others[0]), Path(others[1]))
            typer.echo(table)
            if not parity:
                typer.secho("output parity FAILED: the runs produced different outputs", fg="red", err=True)
                raise typer.Exit(1)
            return
        for path in run_replay(Path(target), base_url, model, arms, pairs, out, echo=typer.echo, pause_s=pause):
            typer.echo(f"receipt: {path}")
    except MtplxError as exc:
        _fail(exc)


@app.command()
def convert(
    src: str = typer.Argument(..., help="A Hugging Face checkpoint: a directory or a cached hub id (org/name)."),
    dst: Path = typer.Argument(..., help="The MLX directory to write (must not exist)."),
    bits: int = typer.Option(4, "--bits", "-q", help="Trunk quantization: 4 or 8 (also 2, 3, 5, 6)."),
    group_size: int = typer.Option(64, "--group-size", help="Quantization group size (mlx-lm's default 64)."),
    no_quantize: bool = typer.Option(False, "--no-quantize", help="Keep the trunk in --dtype."),
    head_bits: Optional[int] = typer.Option(None, "--head-bits", help="Quantize the MTP head too (default: keep it in --dtype)."),
    embed_bits: Optional[int] = typer.Option(None, "--embed-bits", help="Bits of the embedding and LM head, which the "
                                             "MTP head drafts through (default: 8 with a head, else --bits)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32 for what is not quantized."),
) -> None:
    """Convert a Hugging Face checkpoint to MLX: trunk quantized as mlx-lm does, MTP head kept."""
    from mtplx.catalog import resolve
    from mtplx.convert import convert as run_convert

    try:
        summary = run_convert(resolve(src), dst, None if no_quantize else bits, group_size, head_bits, dtype, embed_bits)
    except MtplxError as exc:
        _fail(exc)
    typer.echo(f"wrote {dst}: trunk {summary['trunk']}, MTP head "
               + (summary["head"] or "none (the source has no MTP weights)"))


receipts_app = typer.Typer(help="Browse the receipt store ($MTPLX_HOME/receipts.db): one row per turn.", no_args_is_help=True)
app.add_typer(receipts_app, name="receipts")


@receipts_app.command("ls")
def receipts_ls(
    limit: int = typer.Option(30, "--limit", "-n", min=1),
    session: Optional[str] = typer.Option(None, "--session"),
    source: Optional[str] = typer.Option(None, "--source", help="tui, api, replay, cli"),
) -> None:
    """List the newest receipts."""
    from mtplx.receipts.report import listing
    from mtplx.receipts.store import ReceiptStore

    where, params = _receipt_filter(session, source)
    rows = ReceiptStore().rows(where, params)[-limit:]
    typer.echo(listing(rows) if rows else "no receipts yet")


def _receipt_filter(session, source):
    clauses, params = [], []
    for column, value in (("session", session), ("source", source)):
        if value:
            clauses.append(f"{column} = ?")
            params.append(value)
    return (" and ".join(clauses) or None), tuple(params)


@receipts_app.command("show")
def receipts_show(receipt_id: str = typer.Argument(..., help="A receipt id (or a unique prefix).")) -> None:
    """Show one receipt in full, with its raw request."""
    from mtplx.receipts.report import detail
    from mtplx.receipts.store import ReceiptStore

    row = ReceiptStore().get(receipt_id)
    if row is None:
        _fail(MtplxError(f"no single receipt matches {receipt_id!r}"))
    typer.echo(detail(row))


@receipts_app.command("export")
def receipts_export(
    fmt: str = typer.Option("csv", "--format", "-f", help="csv or json"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write here instead of stdout."),
    session: Optional[str] = typer.Option(None, "--session"),
    source: Optional[str] = typer.Option(None, "--source"),
) -> None:
    """Export receipts as CSV or JSON."""
    from mtplx.receipts.store import ReceiptStore

    if fmt not in ("csv", "json"):
        _fail(MtplxError(f"--format must be csv or json, got {fmt!r}"))
    store = ReceiptStore()
    text = store.export(fmt, store.rows(*_receipt_filter(session, source)))
    if out:
        out.write_text(text)
    else:
        typer.echo(text)


@receipts_app.command("compare")
def receipts_compare(
    run_a: str = typer.Argument(..., help="A replay run id (see receipt files or `receipts ls --source replay`)."),
    run_b: str = typer.Argument(...),
) -> None:
    """Two replay runs side by side per turn: ceiling, cached, ratio, TTFT; exits 1 on output mismatch."""
    from mtplx.receipts.report import side_by_side
    from mtplx.receipts.store import ReceiptStore

    store = ReceiptStore()
    a, b = (store.rows("replay_run = ?", (run,)) for run in (run_a, run_b))
    if not a or not b:
        _fail(MtplxError(f"no receipts for replay run {run_a if not a else run_b!r}"))
    table, parity = side_by_side(a, b, run_a, run_b)
    typer.echo(table)
    if not parity:
        raise typer.Exit(1)


bank_app = typer.Typer(help="The session bank's SSD tier ($MTPLX_HOME/bank).", no_args_is_help=True)
app.add_typer(bank_app, name="bank")


def _ssd(owner: bool = False):
    """The SSD tier: read-only beside a running server; `owner` (clear, gc) needs it stopped."""
    from mtplx.bank.ssd import SsdConfig, SsdTier

    import sqlite3

    config = SsdConfig.default()
    try:
        return SsdTier(config, owner=owner)
    except MtplxError as exc:
        _fail(exc)
    except (OSError, sqlite3.Error) as exc:  # a read-only or missing home, an unreadable manifest
        _fail(MtplxError(f"the SSD bank at {config.root} cannot be opened: {exc}"))


@bank_app.command("ls")
def bank_ls() -> None:
    """List persisted entries: id, session, tokens, size, anchors."""
    tier = _ssd()
    rows = list(tier.db.execute("select entry_id, session, token_count, nbytes, anchors, last_used from entries order by last_used desc"))
    if not rows:
        typer.echo("no persisted entries")
    for entry_id, session, count, nbytes, anchors, _ in rows:
        kinds = ",".join(sorted({k for _, k in json.loads(anchors)}))
        typer.echo(f"{entry_id}  {str(session or '-')[:24]:<24} {count:>7} tokens {nbytes / 1024:>9.0f} KiB  anchors: {kinds}")


@bank_app.command("stats")
def bank_stats() -> None:
    """Entries, bytes used, budget and free disk."""
    for key, value in _ssd().stats().items():
        typer.echo(f"{key}: {value}")


@bank_app.command("clear")
def bank_clear() -> None:
    """Delete every persisted entry."""
    typer.echo(f"deleted {_ssd(owner=True).clear()} entries")


@bank_app.command("gc")
def bank_gc() -> None:
    """Remove temp files and orphans, then enforce the byte budget and free-disk floor."""
    tier = _ssd(owner=True)
    removed = tier.reconcile()
    dropped = tier.enforce_budget()
    typer.echo(f"removed {removed}; evicted {len(dropped)} entries over budget")


def main() -> None:
    import os

    # transformers' import-time advice that PyTorch is missing: mtplx runs models on MLX and uses
    # transformers for tokenizers and configs only, so the line would only mislead.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    app()


if __name__ == "__main__":
    main()
