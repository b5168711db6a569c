# The course's JupyterLab Terminal (tools/lab_config.py starts bash with this rc file): your own ~/.bashrc
# first, then the course environment's bin first on PATH, so `python -m ampcourse...` and `torchrun` in the
# Terminal are the course's (a login shell's /etc/profile, or a conda line in ~/.bashrc, would otherwise put
# another Python first: "No module named 'ampcourse'").
if [ -f "$HOME/.bashrc" ]; then
    . "$HOME/.bashrc"
fi
if [ -n "${AMPCOURSE_BIN:-}" ]; then
    export PATH="$AMPCOURSE_BIN:$PATH"
fi
