"""The mocker behind a stock engine's face: its HTTP API, metric names and KV events."""
