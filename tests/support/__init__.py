"""Harness code the test folders share: rank pools, the tests' own sharding oracle, read counters,
an S3 server, a tiny Llama, and the crash workers. Nothing here is collected as tests."""
