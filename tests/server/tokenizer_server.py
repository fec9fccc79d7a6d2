"""A real uvicorn server over a TINY random Llama with the default model's tokenizer.

The model has the default model's vocabulary size (49152) but two 64-wide layers, and
the engine gets the real tokenizer and chat template of the bundled GGUF: string
prompts, chat rendering, stop strings, detokenization and logprobs are exercised for
almost no compute. The random weights make the generated text meaningless.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.engine import LLMEngine
from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import default_model_path
from roseinfer.model.registry import create_model
from roseinfer.server.app import create_app
from roseinfer.server.state import ServerSettings
from roseinfer.tokenizer import Tokenizer
from tests.engine.tiny_models import tiny_hf_llama
from tests.server.helpers import Gate, ServerThread, TinyServer

MODEL_NAME = "tiny-smollm2-tok"
VOCAB_SIZE = 49152  # the default model's
MAX_POSITIONS = 1024


class TcpServerThread(ServerThread):
    """``ServerThread`` on a socket created as IPPROTO_TCP: asyncio turns Nagle off
    (TCP_NODELAY) only on such sockets, and with Nagle on every response waits ~40 ms
    for the client's delayed ACK between its header and body writes."""

    def __init__(self, app) -> None:  # noqa: ANN001
        super().__init__(app)
        self.sock.close()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)


def tokenizer_engine(num_kv_blocks: int = 96, block_size: int = 16, **options) -> LLMEngine:
    """An LLMEngine over the tiny random Llama with the default model's tokenizer."""
    tokenizer = Tokenizer.from_model_path(default_model_path())
    assert tokenizer.vocab_size == VOCAB_SIZE, tokenizer.vocab_size
    hf = tiny_hf_llama(vocab=VOCAB_SIZE, max_positions=MAX_POSITIONS)
    model_config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(model_config, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    config = EngineConfig(num_threads=1, quantization="none", block_size=block_size,
                          num_kv_blocks=num_kv_blocks, **options)
    return LLMEngine(config, model=model, model_config=model_config, tokenizer=tokenizer)


@contextlib.contextmanager
def tokenizer_server(settings: ServerSettings | None = None, max_waiting_requests: int | None
                     = None, **engine_options) -> Iterator[TinyServer]:
    """Serve ``tokenizer_engine(**engine_options)`` on 127.0.0.1 (``MODEL_NAME``)."""
    engine = tokenizer_engine(**engine_options)
    gate = Gate(engine)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
    settings = settings or ServerSettings(served_model_names=(MODEL_NAME,))
    with TcpServerThread(create_app(async_engine, settings)) as st:
        try:
            yield TinyServer(st.url, async_engine, gate)
        finally:
            gate.open()
