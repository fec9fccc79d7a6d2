"""Screenshots of the web UI (chat and dashboard) while requests run.

Starts ``roseinfer serve`` on 127.0.0.1 (the default model, ``--serve-args``) or uses
``--url``; keeps ``--clients`` streaming chat requests going in the background, asks
one question in the chat page of headless chromium (Debian's, through Playwright),
and saves PNGs of both views, wide and narrow, to ``--out`` (``benchmarks/results/``,
not committed).

    .venv/bin/python benchmarks/ui_screenshots.py
    .venv/bin/python benchmarks/ui_screenshots.py --url http://127.0.0.1:8000 --clients 2
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx

from roseinfer.bench.server_process import start_server, stop_server, wait_healthy

RESULTS = Path(__file__).parent / "results"
QUESTION = ("Write a short Python function that reverses a string, in a code block, "
            "then list two ways to test it.")
LOAD_PROMPTS = ["Tell me about the history of tea.", "Explain how a bicycle works.",
                "Describe a walk in the mountains.", "What makes a good cup of coffee?"]
SIZES = {"wide": (1280, 900), "narrow": (390, 844)}


def background_load(url: str, clients: int, headers: dict[str, str],
                    stop: threading.Event) -> list[threading.Thread]:
    """``clients`` threads each streaming chat completions until ``stop`` is set."""

    def client(i: int) -> None:
        body = {"messages": [{"role": "user", "content": LOAD_PROMPTS[i % len(LOAD_PROMPTS)]}],
                "max_tokens": 160, "temperature": 0.8, "stream": True}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


@contextlib.contextmanager
def served(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url.rstrip("/")
        return
    proc, url = start_server(args.serve_args, args.out / "ui_screenshots_server.log")
    try:
        wait_healthy(url, proc, timeout=300)
        yield url
    finally:
        stop_server(proc)


def shoot(url: str, args: argparse.Namespace) -> list[Path]:
    from playwright.sync_api import sync_playwright

    saved: list[Path] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium)
        try:
            for name, (width, height) in SIZES.items():
                context = browser.new_context(viewport={"width": width, "height": height},
                                              device_scale_factor=1)
                if args.api_key:
                    context.add_init_script(
                        f"localStorage.setItem('roseinfer.apiKey', {args.api_key!r})")
                page = context.new_page()
                page.goto(url + "/#chat")
                page.fill("#temperature", "0")
                page.fill("#max-tokens", "160")
                page.fill("#prompt", QUESTION)
                page.press("#prompt", "Enter")
                page.wait_for_selector(".msg.assistant:not(.streaming) .meta:not(:empty)",
                                       timeout=300_000)
                saved.append(args.out / f"ui_chat_{name}.png")
                page.screenshot(path=str(saved[-1]), full_page=True)
                page.goto(url + "/#dashboard")
                page.wait_for_function("() => Number(document.querySelector('#stat-running')"
                                       ".textContent) > 0", timeout=120_000)
                page.wait_for_timeout(1500)  # a few polls: the charts fill in
                saved.append(args.out / f"ui_dashboard_{name}.png")
                page.screenshot(path=str(saved[-1]), full_page=True)
                context.close()
        finally:
            browser.close()
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="use this server instead of starting one")
    ap.add_argument("--serve-args", default="--max-num-seqs 16",
                    help="arguments of the `roseinfer serve` this script starts")
    ap.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    ap.add_argument("--clients", type=int, default=4, help="background streaming clients")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with served(args) as url:
        stop = threading.Event()
        threads = background_load(url, args.clients, headers, stop)
        try:
            saved = shoot(url, args)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    print(f"server args: {shlex.quote(args.serve_args) if not args.url else args.url}")
    for path in saved:
        print(f"saved {path}")


if __name__ == "__main__":
    main()
