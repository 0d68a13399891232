"""turnout attach: running vLLM, SGLang and llama.cpp servers registered as turnout workers."""
