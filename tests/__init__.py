"""kvgate's tests, one folder per package under test (a test of gateway/events/subscriber.py is
tests/gateway/test_subscriber.py, of worker/engine/block_manager.py
tests/worker/engine/test_block_manager.py):

- cachekey/, gateway/ (epp/, discovery/), worker/ (engine/, models/, server/), harness/: the
  packages of the same names;
- k8s/: the Helm chart, manifests/ and the dashboard; bench/: the bench/ scripts, as run;
- system/: suites over whole clusters (acceptance, faults, the error vocabulary, real vLLM);
- project/: rules over the repository (imports, locks, the release workflow, command lines);
- support/: the helpers tests import (fake servers, worker processes, waits, chat requests);
- fixtures/: recorded data (vLLM's KV events, the InferencePool CRD).

conftest.py holds the fixtures every folder shares and keeps `-m vllm` tests out of other runs.
"""
