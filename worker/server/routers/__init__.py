"""The worker's endpoints, one router per concern; each reaches its handlers through
`request.app.state` (`worker_state`), filled once by `init_app_state`."""
