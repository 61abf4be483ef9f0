"""One fenced request's path: intake (the facts the request carries) → the decision →
the admission in the database (``records``) → the forward (``upstream``) → the answer.

``handler`` performs the steps and holds no rule of its own; ``intake`` reads the request,
``body`` its body, ``duplicates`` waits for a duplicate in flight, ``answers`` renders the
gateway's own answers (counted, logged, audited), ``resolve`` settles unknown outcomes
with the destination's help."""
