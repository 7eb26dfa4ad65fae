"""Schema-driven fuzzing (schemathesis) of both apps' OpenAPI documents: no input gives a 5xx, and every
response (200s and the declared 4xx/503s) conforms to the documented status codes, content types, headers
and schemas. Bounded: ~30 examples per operation, no deadline."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import load_config
from rlt2t.services import policy_app, reward_app

pytestmark = pytest.mark.integration

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def fuzz_cfg(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz")
    # Small limits keep each example cheap: at most 4 sources x 3 candidates x 8 new tokens on the tiny model.
    return load_config([], [f"run.dir={run}", "model.preset=tiny", "serve.max_wait_ms=0",
                            "serve.max_sources_per_call=4", "serve.max_candidates_per_source=3",
                            "serve.max_tokens_per_source=32", "rollout.num_samples=2",
                            "rollout.max_new_tokens=8"])


@pytest.fixture(scope="module", params=["torch", "ct2"])
def policy_schema(request, fuzz_cfg, ids_tokenizer_dir, tmp_path_factory):
    """The policy app on each backend (the CTranslate2 one has its own limits to map to 4xx)."""
    from rlt2t.common.config import ModelConfig
    from rlt2t.common.policy import load_policy

    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    save_checkpoint(root, "epoch-0001", model=policy.model, tokenizer=policy.tokenizer, step=1)
    cfg = fuzz_cfg.model_copy(update={"serve": fuzz_cfg.serve.model_copy(update={"backend": request.param})})
    app = policy_app.create_app(cfg, checkpoint_dir=root)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def reward_schema(fuzz_cfg):
    return schemathesis.openapi.from_asgi("/openapi.json", reward_app.create_app(fuzz_cfg))


def fuzz(schema) -> list[str]:
    """Run the checks on ~30 positive and ~30 negative examples of every operation; returns what ran."""
    ran = []
    for result in schema.get_all_operations():
        operation = result.ok()
        # Routes without a body (the GETs, POST /v1/reload) take no input: no invalid request to generate.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(operation.body) else [])
        for mode in modes:

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                case.call_and_validate(checks=CHECKS)

            check()
            ran.append(f"{operation.method.upper()} {operation.path} {mode.value}")
    return ran


def test_policy_api(policy_schema):
    ran = fuzz(policy_schema)
    for route in ("POST /v1/candidates", "POST /v1/pairs", "POST /v1/score", "GET /v1/model", "GET /metrics"):
        assert f"{route} positive" in ran


def test_reward_api(reward_schema):
    assert "POST /v1/reward negative" in fuzz(reward_schema)
