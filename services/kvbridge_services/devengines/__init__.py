"""Development vLLM engines: a tiny generated model and a launcher for one prefill + one decode CPU engine.

For ``kvbridge up --engines`` (local development, the README demo) and the e2e tests; not a deployment tool.
"""
