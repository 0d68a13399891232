"""Real etcd and NATS servers for the tests, started on free ports and stopped after."""
