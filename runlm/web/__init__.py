"""HTTP pieces both servers share (the engine server, runlm/server, and the daemon, runlm/runner): request
bodies parsed one way, and pure-ASGI guards (body size, browser requests) that answer in the caller's
error shape."""
