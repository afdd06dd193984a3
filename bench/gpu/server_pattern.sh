# Sourced by stop_stale_servers.sh and e2e_watchdog.sh: the SGLang server processes, as
# pgrep -f's regex (the launcher and the scheduler / detokenizer children, which SGLang
# names `sglang::...`). SERVER_PATTERN overrides it: the CPU tests name processes of
# their own, since CI's other leg runs real SGLang servers meanwhile.
SERVER_PATTERN="${SERVER_PATTERN:-sglang[.]launch_server|sglang::}"
