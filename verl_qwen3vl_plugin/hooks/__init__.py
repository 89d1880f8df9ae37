"""The modules verl's plugin loading imports: entry points (verl >= 0.9), ``VERL_USE_EXTERNAL_MODULES``, or the
plugin's start-up hook. Each installs the patches of its group (``registry.HOOK_MODULES``) and never raises."""
