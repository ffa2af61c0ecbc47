"""`python -m nanoserve.ext.server --model DIR --port 8000`: the server, every EngineConfig and ServerConfig field a
flag (app.py's main)."""

from nanoserve.ext.server.app import main

main()
