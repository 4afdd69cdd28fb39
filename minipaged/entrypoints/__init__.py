"""How users reach the engine: LLM, the command line, the OpenAI-compatible server, the demo."""
