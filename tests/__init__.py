"""The test suite: a package, so that tests import their shared modules as ``tests.helpers`` and so on."""
