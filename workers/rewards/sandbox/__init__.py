"""The code sandbox behind the ``code_sandbox`` reward: isolation, the in-sandbox harness, the test formats, the
verdicts (verdicts.py), the pool of pre-started sandboxes (prestarted.py) and the remote (SandboxFusion) client. ``workers/rewards/code_sandbox.py``
is the scorer that ties them together; docs/code-sandbox.md describes the whole."""
