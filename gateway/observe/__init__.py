"""What the gateway tells its operators: ``logs`` (JSON lines, secrets redacted),
``metrics`` (Prometheus), ``tracing`` (OpenTelemetry spans, optional)."""
