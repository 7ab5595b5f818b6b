from r3090d.cli import daemon_main

daemon_main()
