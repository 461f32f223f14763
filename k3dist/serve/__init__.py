"""Serve layer: a rank's start-up and the HTTP APIs over one lockstep core.

Rank start-up (``rank``: what ``launch/serve.py`` runs), the rank-folder loader with its
checks (``loader``), preflight, warm-up, the peer watchdog (``watchdog``, over its wire
``peer_link`` and process endings ``peer_process``), keep-awake, the supervisor, its
hosts' ssh checks and its command (``supervise``, ``hosts``, ``launch``), the lockstep
generation core (``lockstep``), one thin module per HTTP API (``openai_api``,
``anthropic_api``, ``responses_api``, ``prefix_api``) under one handler (``handler``,
``admission``) and server (``server``), prompt caches (``prompt_cache``,
``prefix_store``), metrics and the status page (``metrics``, ``status_page``) and images
(``vision``). Imports format, config and model only."""
