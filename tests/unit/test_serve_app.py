"""The serve app in-process (the tiny model, Starlette's test client): what the network tests cannot
make happen on purpose, a bug in a route, answered as a 500 in OpenAI's shape with one log line."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    from lodger.model import model_folder, resolve_source
    from lodger.serve.app import create_app
    from lodger.serve.auth import Guard, allowed_hosts
    from lodger.serve.engine import Engine

    engine = Engine(model_folder(resolve_source(str(tiny_model_dir))))
    app = create_app(engine, guard=Guard("s3cret", allowed_hosts("testserver", 80)))

    def broken() -> dict:
        raise RuntimeError("a bug in a route")

    app.add_api_route("/v1/broken", broken, methods=["GET"])
    return app


def test_an_unexpected_error_is_a_500_in_openai_shape_without_traceback(app, caplog, capfd):
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as client, caplog.at_level(logging.INFO, "lodger.serve"):
        response = client.get("/v1/broken", headers={"authorization": "Bearer s3cret"})
        assert response.status_code == 500
        assert response.json() == {"error": {"message": "internal error (RuntimeError); the server log has details",
                                             "type": "server_error", "param": None, "code": "internal_error"}}
        assert client.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["internal error on GET /v1/broken: RuntimeError: a bug in a route"], errors
    assert any("GET /v1/broken 500" in r.getMessage() for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
