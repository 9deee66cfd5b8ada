"""engine=openai: an OpenAI-compatible endpoint (a vLLM or SGLang server, a gateway, a hosted API) as the job's
engine. config.py holds its settings (imported by the registry, no HTTP library); engine.py talks to the endpoint;
wire.py turns a Request into a request body and a response into a Result; dispatch.py keeps the requests in flight."""
