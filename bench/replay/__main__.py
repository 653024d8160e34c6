from bench.replay.run import main

raise SystemExit(main())
