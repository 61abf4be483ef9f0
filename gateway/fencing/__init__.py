"""The fencing rules, pure: no I/O, no web server, no database, no settings.

``decision`` is the table that turns a request's facts into one ``Verdict``; ``fence`` the
rules behind its facts (keys, fingerprints, a lease's and a record's state, the send);
``after_forward`` the small table of answers after the forward; ``profiles`` what an
upstream's answer means for its idempotency key. A ``Reason`` is chosen here and nowhere
else (tests/unit/test_decision_is_the_only_chooser.py)."""
