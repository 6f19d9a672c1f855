"""Clients and a server over the viewer's run (``view_run``, tests/conftest.py; written by
``tests/viewer/run_builder.py``)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def view_client(view_run):
    from starlette.testclient import TestClient

    from viewer.app import create_app

    return TestClient(create_app(view_run["run"]), base_url="http://127.0.0.1")   # a Host the app answers


@pytest.fixture(scope="session")
def view_server(view_run):
    """The app served by uvicorn on a loopback port in this process: its base URL."""
    from viewer.app import create_app
    from viewer.serve import serving_in_thread

    with serving_in_thread(create_app(view_run["run"])) as url:
        yield url
