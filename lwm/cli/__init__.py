"""The command line: the ``lwm`` dispatcher (:mod:`lwm.cli.main`), the LightningCLI, one file per verb."""
