"""The OpenAI ingress over peer groups: Ray Serve LLM's `OpenAiIngress`, with one engine
deployment per peer group behind each model id instead of one.

A request goes to the groups in turn; inside a group Serve's router picks the replica. Routing
per group here is where a group that is restarting can later be skipped.
"""

from __future__ import annotations

import itertools

from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress


class PeerGroupIngress(OpenAiIngress):
    def __init__(self, llm_deployments: dict, model_cards: dict, *, peer_groups: dict, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._group_handles = {model_id: [h.options(stream=True) for h in handles]
                               for model_id, handles in peer_groups.items()}
        self._turn = itertools.count()

    def _get_configured_serve_handle(self, model_id: str):
        handles = self._group_handles.get(model_id)
        if not handles:  # not a base model id (e.g. a LoRA id): Ray Serve LLM's own lookup
            return super()._get_configured_serve_handle(model_id)
        return handles[next(self._turn) % len(handles)]
