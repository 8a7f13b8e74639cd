from ddtree.cli import main

raise SystemExit(main())
