"""The `hermes-sup` command line: main.py holds the command group and the
client commands, serve.py the supervisor's own command and settings, keys.py
remote front ends' keys, service.py the systemd unit, show.py the output."""
