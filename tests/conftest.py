"""Fixtures shared by the server test modules: each module starts its own server (its `server`
fixture, with the flags it tests), and these give it the official openai client and the served
model's name."""
from __future__ import annotations

import openai
import pytest

from server_utils import RemoteServer


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
