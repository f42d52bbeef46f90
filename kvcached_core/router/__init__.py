"""`kvrouter`: many models behind one OpenAI endpoint, on shared devices.

`config.py` reads the YAML file, `engines.py` runs one engine server and sleeps and wakes it
through its pools' limit records, `fleet.py` decides which engines run, sleep or stop,
`frontend.py` serves the endpoint, `telemetry.py` its metrics, `cli.py` the command.
docs/router.md is the user's guide.
"""
