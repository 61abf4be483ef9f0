"""How the environment reaches the configuration: the ``FENCEGATE_*`` variables
(``gateway.config.load``) and ``${NAME}`` references in secret values, expanded only by
``gateway.config.secrets.resolve_secrets``."""

from __future__ import annotations

import re

ENV_PREFIX = "FENCEGATE_"
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
